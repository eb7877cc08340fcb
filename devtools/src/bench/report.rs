//! `vps bench report`: one node's complete `nodes.report` of `--guests` running guests (10,000
//! by default) that changes nothing, and one that changes one guest (an address it gained),
//! against the same run's complete report of a node with `--small` guests (10). Each figure is
//! the p50 of `--repeats` reports, alternated so drift hits all three alike. Also the
//! `nodes.spec` answer of each node (the host's long poll answered at once).
//!
//! The guests are created over HTTP and placed by the server's own reconciler; the bench then
//! acts as both hosts: it reads each node's spec and reports every guest `RUNNING` with its
//! leased address. No emulated host runs, so nothing else reports while the figures are taken.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};

use super::{percentile, round, run_writers, BenchRange, Creates, Scratch, Stop};

/// Knobs.
#[derive(Debug, Clone)]
pub struct ReportBench {
    /// Guests on the big node.
    pub guests: usize,
    /// Guests on the small node (the baseline).
    pub small: usize,
    /// Reports measured of each kind.
    pub repeats: usize,
}

/// What a run measured and saw, samples in milliseconds (sorted).
#[derive(Debug, Clone, Default)]
pub struct ReportFigures {
    /// The big node's complete reports that change nothing.
    pub big: Vec<f64>,
    /// The big node's complete reports that change one guest.
    pub one_change: Vec<f64>,
    /// The small node's complete reports that change nothing.
    pub small: Vec<f64>,
    /// `nodes.spec` of the big node.
    pub spec_big: Vec<f64>,
    /// `nodes.spec` of the small node.
    pub spec_small: Vec<f64>,
    /// `nodes.spec` of the big node until its answer's headers: the answer is built whole
    /// before they are sent, so this is its build without the transfer of its megabytes.
    pub spec_big_headers: Vec<f64>,
    /// The big node's first report (every guest becomes `running`).
    pub first_ms: f64,
    /// `updated` of that first report.
    pub first_updated: u64,
    /// `updated` of each report that changes nothing (big and small).
    pub unchanged_updated: Vec<u64>,
    /// `updated` of each one-change report.
    pub one_change_updated: Vec<u64>,
    /// The guests the one-change reports changed, in order.
    pub changed: Vec<String>,
    /// Entries in the big node's spec.
    pub spec_entries: usize,
}

impl ReportFigures {
    /// The JSON line.
    pub fn json(&self, o: &ReportBench) -> Value {
        let (big, one, small) = (
            percentile(&self.big, 0.5),
            percentile(&self.one_change, 0.5),
            percentile(&self.small, 0.5),
        );
        json!({
            "guests": o.guests,
            "small_guests": o.small,
            "repeats": o.repeats,
            "report_10k_ms": round(big, 2),
            "report_10k_one_change_ms": round(one, 2),
            "report_10_ms": round(small, 2),
            "report_10k_p99_ms": round(percentile(&self.big, 0.99), 2),
            "report_10k_one_change_p99_ms": round(percentile(&self.one_change, 0.99), 2),
            "report_10_p99_ms": round(percentile(&self.small, 0.99), 2),
            "one_change_ratio": round(one / small, 2),
            "unchanged_ratio": round(big / small, 2),
            "first_report_ms": round(self.first_ms, 1),
            "nodespec_10k_ms": round(percentile(&self.spec_big, 0.5), 2),
            "nodespec_10_ms": round(percentile(&self.spec_small, 0.5), 2),
            "nodespec_10k_headers_ms": round(percentile(&self.spec_big_headers, 0.5), 2),
            "nodespec_ratio": round(
                percentile(&self.spec_big, 0.5) / percentile(&self.spec_small, 0.5), 2),
        })
    }
}

/// Runs the benchmark and prints the figures, JSON line last.
pub async fn run(server_url: &str, o: &ReportBench) -> anyhow::Result<()> {
    let figures = measure(server_url, o).await?;
    let line = figures.json(o);
    println!(
        "first complete report of {} guests (all become running): {:.1} ms",
        o.guests, figures.first_ms
    );
    println!(
        "complete report, nothing changed: {} guests p50 {} ms, {} guests p50 {} ms (ratio {})",
        o.guests, line["report_10k_ms"], o.small, line["report_10_ms"], line["unchanged_ratio"]
    );
    println!(
        "complete report, one guest changed: {} guests p50 {} ms (ratio to {} guests {}; target ≤ 3)",
        o.guests, line["report_10k_one_change_ms"], o.small, line["one_change_ratio"]
    );
    println!(
        "nodes.spec: {} entries p50 {} ms ({} ms until the answer's headers), {} entries p50 {} ms",
        figures.spec_entries,
        line["nodespec_10k_ms"],
        line["nodespec_10k_headers_ms"],
        o.small,
        line["nodespec_10_ms"]
    );
    println!("{}", serde_json::to_string(&line)?);
    Ok(())
}

/// Sets up a scratch database and server, measures, and drops them.
pub async fn measure(server_url: &str, o: &ReportBench) -> anyhow::Result<ReportFigures> {
    let scratch = Scratch::create(server_url, 40).await?;
    let (mut config, token) = super::server_config();
    config.timings.transitional_look = 0.5;
    config.timings.unschedulable_retry = 0.5;
    let server = vps_api::server::start(config, scratch.pool.clone()).await;
    let result = match server {
        Ok(server) => {
            let done = phases(&server, &token, o).await;
            server.shutdown().await;
            done
        }
        Err(e) => Err(e),
    };
    scratch.drop_database().await?;
    result
}

/// One node as the bench reports for it.
struct Host {
    http: reqwest::Client,
    url: String,
    node_id: String,
    token: String,
}

impl Host {
    async fn post(&self, call: &str, body: Vec<u8>) -> anyhow::Result<Value> {
        let response = self
            .http
            .post(format!("{}/api/compute/nodes/{call}", self.url))
            .bearer_auth(&self.token)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await?;
        let status = response.status();
        let answer: Value = response.json().await?;
        anyhow::ensure!(
            status.is_success(),
            "nodes.{call} answered {status}: {answer}"
        );
        Ok(answer)
    }

    /// A timed call, until its answer's last byte (parsed after); the answer and milliseconds.
    async fn timed(&self, call: &str, body: Vec<u8>) -> anyhow::Result<(Value, f64)> {
        let (answer, ms, _) = self.timed_with_headers(call, body).await?;
        Ok((answer, ms))
    }

    /// [`Host::timed`], also answering the milliseconds until the answer's headers.
    async fn timed_with_headers(
        &self,
        call: &str,
        body: Vec<u8>,
    ) -> anyhow::Result<(Value, f64, f64)> {
        let started = Instant::now();
        let response = self
            .http
            .post(format!("{}/api/compute/nodes/{call}", self.url))
            .bearer_auth(&self.token)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await?;
        let headers_ms = started.elapsed().as_secs_f64() * 1000.0;
        let status = response.status();
        let bytes = response.bytes().await?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        let answer: Value = serde_json::from_slice(&bytes)?;
        anyhow::ensure!(
            status.is_success(),
            "nodes.{call} answered {status}: {answer}"
        );
        Ok((answer, ms, headers_ms))
    }

    fn spec_body(&self) -> Vec<u8> {
        json!({ "nodeId": self.node_id }).to_string().into_bytes()
    }

    /// A report of `entries` (complete or not) as the wire carries it.
    fn report_body(&self, entries: &[Value], complete: bool) -> Vec<u8> {
        json!({ "nodeId": self.node_id, "instances": entries, "complete": complete })
            .to_string()
            .into_bytes()
    }

    /// Reports now and then (so the node counts as alive) until its spec lists `n` instances;
    /// answers the spec.
    async fn await_spec(&self, n: usize) -> anyhow::Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            self.post("report", self.report_body(&[], false)).await?;
            let spec = self.post("spec", self.spec_body()).await?;
            let listed = spec["instances"].as_array().map_or(0, Vec::len);
            if listed >= n {
                return Ok(spec);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "node {} lists {listed} of {n} instances",
                self.node_id
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Every guest of a spec `RUNNING` at its leased address.
fn running_entries(spec: &Value) -> Vec<Value> {
    let none = Vec::new();
    spec["instances"]
        .as_array()
        .unwrap_or(&none)
        .iter()
        .map(|i| {
            let addresses: Vec<&str> = i["nics"]
                .as_array()
                .unwrap_or(&none)
                .iter()
                .filter_map(|n| n["address"].as_str())
                .map(|a| a.split_once('/').map_or(a, |(ip, _)| ip))
                .collect();
            json!({ "id": i["id"], "state": "RUNNING", "addresses": addresses })
        })
        .collect()
}

async fn phases(
    server: &vps_api::server::RunningServer,
    token: &str,
    o: &ReportBench,
) -> anyhow::Result<ReportFigures> {
    let ctx = vps_api::server::reactor_ctx(&server.state, "bench");
    let total = (o.guests + o.small) as u64;
    let range = BenchRange {
        name: "bench",
        runtime: None,
        cidr: "10.0.0.0/16",
        gateway: None,
        quota: total * 2,
    };
    let pool_id = super::pool_with_flavor(&ctx, &range).await?;
    super::register_bench_image(&ctx).await?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let creates = Creates::new(http.clone(), &server.url(), token, &pool_id);

    // The small node first, alone, so its guests all land on it; then the big one.
    let small = register(&ctx, &server.url(), &http, &pool_id, "small", o.small).await?;
    small.post("report", small.report_body(&[], true)).await?;
    create(&creates, "s", o.small).await?;
    let small_spec = small.await_spec(o.small).await?;
    let big = register(&ctx, &server.url(), &http, &pool_id, "big", o.guests).await?;
    big.post("report", big.report_body(&[], true)).await?;
    let started = Instant::now();
    create(&creates, "b", o.guests).await?;
    let big_spec = big.await_spec(o.guests).await?;
    println!(
        "{} guests created and placed in {:.1} s",
        o.guests,
        started.elapsed().as_secs_f64()
    );

    let mut f = ReportFigures::default();
    let small_entries = running_entries(&small_spec);
    small
        .post("report", small.report_body(&small_entries, true))
        .await?;
    let mut entries = running_entries(&big_spec);
    f.spec_entries = entries.len();
    let (answer, ms) = big.timed("report", big.report_body(&entries, true)).await?;
    f.first_ms = ms;
    f.first_updated = answer["updated"].as_u64().unwrap_or_default();
    // The reactors catch up with the build first (both nodes reporting, as hosts do).
    let waiting = Instant::now();
    let mut quiet = super::Quiet::default();
    while !quiet.settled(&ctx.pool, Duration::from_secs(3)).await? {
        anyhow::ensure!(
            waiting.elapsed() < Duration::from_secs(600),
            "the log or a follower still moves after 600 s"
        );
        big.post("report", big.report_body(&entries, true)).await?;
        small
            .post("report", small.report_body(&small_entries, true))
            .await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "reactors caught up with the build {:.1} s after the first report",
        waiting.elapsed().as_secs_f64()
    );
    // Warm both paths (plans, caches) before the samples.
    for _ in 0..3 {
        big.post("report", big.report_body(&entries, true)).await?;
        small
            .post("report", small.report_body(&small_entries, true))
            .await?;
    }
    let small_body = small.report_body(&small_entries, true);
    for i in 0..o.repeats {
        let (answer, ms) = small.timed("report", small_body.clone()).await?;
        f.small.push(ms);
        f.unchanged_updated
            .push(answer["updated"].as_u64().unwrap_or(u64::MAX));

        let (answer, ms) = big.timed("report", big.report_body(&entries, true)).await?;
        f.big.push(ms);
        f.unchanged_updated
            .push(answer["updated"].as_u64().unwrap_or(u64::MAX));

        // Guest i gains an address (a second NIC came up): one guest's data changes.
        let k = i % entries.len().max(1);
        let extra = format!("fd00::{:x}", i + 1);
        if let Some(list) = entries[k]["addresses"].as_array_mut() {
            list.push(extra.into());
        }
        f.changed
            .push(entries[k]["id"].as_str().unwrap_or_default().to_string());
        let body = big.report_body(&entries, true);
        let (answer, ms) = big.timed("report", body).await?;
        f.one_change.push(ms);
        f.one_change_updated
            .push(answer["updated"].as_u64().unwrap_or(u64::MAX));

        let (_, ms, headers_ms) = big.timed_with_headers("spec", big.spec_body()).await?;
        f.spec_big.push(ms);
        f.spec_big_headers.push(headers_ms);
        let (_, ms) = small.timed("spec", small.spec_body()).await?;
        f.spec_small.push(ms);
    }
    for samples in [
        &mut f.big,
        &mut f.one_change,
        &mut f.small,
        &mut f.spec_big,
        &mut f.spec_small,
        &mut f.spec_big_headers,
    ] {
        samples.sort_by(f64::total_cmp);
    }
    Ok(f)
}

/// A node with room for exactly `guests` [`super::FLAVOR`] instances.
async fn register(
    ctx: &vps_commands::Ctx,
    url: &str,
    http: &reqwest::Client,
    pool_id: &str,
    name: &str,
    guests: usize,
) -> anyhow::Result<Host> {
    use vps_commands::operator::{self as ops, RegisterNode};
    let size = u32::try_from(guests).context("too many guests")?;
    let registered = ops::register_node(
        ctx,
        RegisterNode {
            pool_id: pool_id.parse()?,
            name: name.into(),
            capacity: vps_domain::resources::Capacity {
                vcpu: size,
                memory_gib: size,
                disk_gib: size,
                gpus: vec![],
            },
            labels: Default::default(),
            runtimes: None,
            cpu_model: Some("emulated".into()),
        },
    )
    .await?;
    Ok(Host {
        http: http.clone(),
        url: url.to_string(),
        node_id: registered.node.id,
        token: registered.node_token,
    })
}

/// `n` creates from 16 concurrent clients.
async fn create(creates: &Creates, tag: &str, n: usize) -> anyhow::Result<()> {
    let (creates, tag) = (creates.clone(), tag.to_string());
    run_writers(16, Stop::Total(n as u64), move |w, i| {
        let (creates, key) = (creates.clone(), format!("{tag}-{w}-{i}"));
        async move {
            let response = creates.send(&key).await?;
            let status = response.status();
            anyhow::ensure!(
                status.is_success(),
                "instances.create answered {status}: {}",
                response.text().await.unwrap_or_default()
            );
            Ok(1)
        }
    })
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small run: every report is accepted, a report that changes nothing updates nothing,
    /// and each one-change report updates exactly the one guest it changed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reports_update_only_the_guest_that_changed() {
        let Ok(url) = std::env::var("VPS_TEST_DATABASE_URL") else {
            eprintln!("VPS_TEST_DATABASE_URL is not set: skipped");
            return;
        };
        let o = ReportBench {
            guests: 200,
            small: 10,
            repeats: 5,
        };
        let f = measure(&url, &o).await.unwrap();
        assert_eq!(f.spec_entries, 200);
        assert_eq!(f.first_updated, 200);
        assert!(f.unchanged_updated.iter().all(|u| *u == 0), "{f:?}");
        assert_eq!(f.one_change_updated, vec![1; 5]);
        assert_eq!(f.big.len(), 5);
        let distinct: std::collections::BTreeSet<_> = f.changed.iter().collect();
        assert_eq!(distinct.len(), 5);
    }
}
