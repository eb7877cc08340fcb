//! `vps bench delivery`: events appended at `--rate` per second for `--seconds`, timed from
//! each append's commit to its arrival at a JetStream consumer (through the server's NATS
//! publisher) and at a webhook receiver (through the server's fan-out and dispatcher).
//! Baseline, same run and NATS server: a plain core-NATS publish → subscribe at the same rate.
//! A second of events at the rate goes first, unmeasured, so the figures are the steady state
//! and not the server's start; the p99 of each second of the run is printed too.
//!
//! The bench starts its own `nats-server -js` on a free 127.0.0.1 port with a temporary store,
//! and the whole server in-process (every reactor), as `vps serve` runs it.

use std::collections::HashMap;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, consumer::DeliverPolicy};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use futures::StreamExt;
use serde_json::{json, Value};
use sqlx::PgPool;
use vps_commands::webhooks::{NewWebhook, WebhookSecret};
use vps_events::{append, ExpectedVersion, Metadata, NewEvent, Notifier};

use super::{percentile, Scratch};
use vps_api::config::{Config, NatsConfig};

/// The type of every appended event: an `instance.*` type, so the catalog's `instance.>` stream
/// subject and an `instance.*` subscription take it, without an `instanceId` (the instance
/// waker ignores it).
const EVENT_TYPE: &str = "instance.bench";
/// The stream the server's publisher writes to (its default).
pub(crate) const STREAM: &str = "VPS_EVENTS";
/// Concurrent appenders: enough that a slow commit does not hold the schedule back.
const APPENDERS: usize = 8;
/// How long to wait for the last deliveries after the last append.
const DRAIN: Duration = Duration::from_secs(60);
/// Events appended at the rate for this long before the measured ones (see `phases`).
const WARM_UP: Duration = Duration::from_secs(1);

/// Knobs.
#[derive(Debug, Clone)]
pub struct DeliveryBench {
    /// Events per second.
    pub rate: f64,
    /// How long to append.
    pub seconds: f64,
}

impl DeliveryBench {
    fn events(&self) -> usize {
        (self.rate * self.seconds).round().max(1.0) as usize
    }
}

/// Runs the benchmark and prints the figures, JSON line last.
pub async fn run(server_url: &str, o: &DeliveryBench) -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let scratch = Scratch::create(server_url, 40).await?;
    let result = phases(&scratch, &nats, o).await;
    scratch.drop_database().await?;
    drop(nats);
    let figures = result?;
    println!("{}", serde_json::to_string(&figures)?);
    Ok(())
}

async fn phases(scratch: &Scratch, nats: &NatsServer, o: &DeliveryBench) -> anyhow::Result<Value> {
    let n = o.events();
    let interval = Duration::from_secs_f64(1.0 / o.rate);

    let baseline = core_round_trips(&nats.url(), n, interval).await?;
    println!(
        "baseline: core NATS publish → subscribe, {} messages at {}/s: p50 {:.2} ms, p99 {:.2} ms",
        baseline.len(),
        o.rate,
        percentile(&baseline, 0.5),
        percentile(&baseline, 0.99)
    );

    let receiver = Receiver::start().await?;
    let mut config = Config::default();
    config.http.listen = "127.0.0.1:0".into();
    config.nats = Some(NatsConfig {
        url: nats.url(),
        subject_prefix: String::new(),
    });
    {
        config.secrets.key = Some(data_encoding::BASE64.encode(&rand::random::<[u8; 32]>()));
    }
    // The receiver listens on loopback.
    config.webhooks.allow_private = vec!["127.0.0.0/8".into()];
    let server = vps_api::server::start(config, scratch.pool.clone()).await?;
    let notifier = server.state.notifier.clone();
    let (_, secret) = vps_commands::webhooks::create(
        &vps_api::server::reactor_ctx(&server.state, "bench"),
        NewWebhook {
            url: receiver.url.clone(),
            types: vec!["instance.*".into()],
            tenant_id: None,
            tenant_scope: None,
            allow_private: server.state.config.webhooks.allowed_networks(),
        },
    )
    .await
    .context("create the webhook subscription")?;
    let _ = receiver.secret.set(secret);

    // The publisher creates the stream when it publishes its first event (`webhook.created`).
    let consumer = jetstream_consumer(&nats.url()).await?;
    let nats_arrivals = Arc::new(Mutex::new(HashMap::<String, Instant>::new()));
    let consuming = {
        let arrivals = nats_arrivals.clone();
        tokio::spawn(async move {
            let mut messages = consumer.messages().await?;
            while let Some(message) = messages.next().await {
                let at = Instant::now();
                let message = message?;
                if let Some(id) = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .map(|v| v.as_str().to_string())
                {
                    arrivals
                        .lock()
                        .expect("not poisoned")
                        .entry(id)
                        .or_insert(at);
                }
            }
            anyhow::Ok(())
        })
    };

    let arrivals = [&*nats_arrivals, &*receiver.arrivals];
    let warm = (o.rate * WARM_UP.as_secs_f64()).round().max(1.0) as usize;
    let warmed = warm_up(&scratch.pool, &notifier, warm, interval, arrivals).await;
    let started = Instant::now();
    let commits = match warmed {
        Ok(()) => append_at_rate(&scratch.pool, &notifier, "bench", n, interval).await,
        Err(e) => Err(e),
    };
    let appended_seconds = started.elapsed().as_secs_f64();
    let commits = match commits {
        Ok(c) => c,
        Err(e) => {
            consuming.abort();
            server.shutdown().await;
            return Err(e);
        }
    };
    println!(
        "appended {n} events in {appended_seconds:.2} s ({:.0}/s, {APPENDERS} appenders, one event per transaction)",
        n as f64 / appended_seconds
    );

    wait_for_arrivals(arrivals, n).await;
    consuming.abort();
    server.shutdown().await;
    // Every attempt that did not deliver: a failed attempt holds the subscription's queue for
    // its back-off (deliveries are in log order).
    let failed_attempts: Vec<(Option<i32>, Option<String>, i64)> = sqlx::query_as(
        "SELECT response_code, error, count(*) FROM webhook_deliveries
          WHERE status <> 'delivered' GROUP BY 1, 2 ORDER BY 3 DESC",
    )
    .fetch_all(&scratch.pool)
    .await?;
    for (code, error, count) in &failed_attempts {
        println!(
            "webhook attempts that failed: {count} × {} {}",
            code.map(|c| c.to_string()).unwrap_or_default(),
            error.as_deref().unwrap_or_default()
        );
    }
    let failed_attempts: i64 = failed_attempts.iter().map(|f| f.2).sum();

    let nats_arrivals = nats_arrivals.lock().expect("not poisoned").clone();
    let hook_arrivals = receiver.arrivals.lock().expect("not poisoned").clone();
    let nats_latency = latencies(&commits, &nats_arrivals);
    let hook_latency = latencies(&commits, &hook_arrivals);
    let bad_signatures = receiver.bad_signatures.load(Ordering::Relaxed);
    let last = |arrivals: &HashMap<String, Instant>| {
        arrivals
            .values()
            .max()
            .map(|t| t.duration_since(started).as_secs_f64())
            .unwrap_or(0.0)
    };
    for (what, lat, arrivals) in [
        ("JetStream consumer", &nats_latency, &nats_arrivals),
        ("webhook receiver", &hook_latency, &hook_arrivals),
    ] {
        println!(
            "append → {what}: {}/{n} arrived (last at {:.1} s): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            lat.len(),
            last(arrivals),
            percentile(lat, 0.5),
            percentile(lat, 0.99),
            lat.last().copied().unwrap_or(0.0)
        );
    }
    // How the latency moved over the run: by commit order, the latency of the events at each
    // tenth of the run (a queue that grows shows a ramp, a stall a step).
    let mut by_commit: Vec<(&Instant, &String)> = commits.iter().map(|(id, t)| (t, id)).collect();
    by_commit.sort();
    for (what, arrivals) in [("JetStream", &nats_arrivals), ("webhook", &hook_arrivals)] {
        let steps: Vec<String> = (0..10)
            .map(|d| by_commit[d * (by_commit.len() - 1) / 9])
            .map(|(t, id)| match arrivals.get(id) {
                Some(at) => format!("{:.0}", latency_ms(t, at)),
                None => "-".into(),
            })
            .collect();
        println!(
            "{what} latency over the run (ms, by tenths): {}",
            steps.join(" ")
        );
        // The p99 of each second's events: a start-up cost or a stall shows in its second.
        println!(
            "{what} p99 by second of the run (ms): {}",
            p99_by_second(&by_commit, arrivals).join(" ")
        );
    }
    // Deliveries per second while the webhook queue was never empty tell the dispatcher's
    // service rate (one attempt in flight per subscription).
    let hook_rate = delivery_rate(&hook_arrivals);
    println!("webhook deliveries: {hook_rate:.0}/s from first to last arrival");
    if bad_signatures > 0 {
        println!("{bad_signatures} webhook requests carried a bad signature");
    }
    let baseline_p99 = percentile(&baseline, 0.99);
    let nats_p99 = percentile(&nats_latency, 0.99);
    let ratio = nats_p99 / baseline_p99;
    println!("ratio NATS p99 / core NATS p99: {ratio:.1}");
    let ms = |x: f64| (x * 100.0).round() / 100.0;
    Ok(json!({
        "nats_p50_ms": ms(percentile(&nats_latency, 0.5)),
        "nats_p99_ms": ms(nats_p99),
        "webhook_p50_ms": ms(percentile(&hook_latency, 0.5)),
        "webhook_p99_ms": ms(percentile(&hook_latency, 0.99)),
        "baseline_nats_p50_ms": ms(percentile(&baseline, 0.5)),
        "baseline_nats_p99_ms": ms(baseline_p99),
        "ratio": (ratio * 10.0).round() / 10.0,
        "events": n,
        "rate": o.rate,
        "appended_per_s": (n as f64 / appended_seconds).round(),
        "nats_arrived": nats_latency.len(),
        "webhook_arrived": hook_latency.len(),
        "webhook_bad_signatures": bad_signatures,
        "webhook_deliveries_per_s": hook_rate.round(),
        "webhook_failed_attempts": failed_attempts,
    }))
}

/// Arrivals per second between the first and the last arrival.
fn delivery_rate(arrivals: &HashMap<String, Instant>) -> f64 {
    match (arrivals.values().min(), arrivals.values().max()) {
        (Some(first), Some(last)) if last > first => {
            (arrivals.len() - 1) as f64 / last.duration_since(*first).as_secs_f64()
        }
        _ => 0.0,
    }
}

/// Milliseconds from `sent` to `arrived` (0 if it arrived first).
fn latency_ms(sent: &Instant, arrived: &Instant) -> f64 {
    arrived.saturating_duration_since(*sent).as_secs_f64() * 1000.0
}

/// Appends `warm` events at the rate before the measured ones (streams `bench-warm-<k>`),
/// waits for them at both ends and forgets their arrivals. Not measured: the server has just
/// started, and its first second opens its pool's connections (a backend each) and fills its
/// caches; that second's tail alone would set the run's p99.
async fn warm_up(
    pool: &PgPool,
    notifier: &Notifier,
    warm: usize,
    interval: Duration,
    arrivals: [&Mutex<HashMap<String, Instant>>; 2],
) -> anyhow::Result<()> {
    append_at_rate(pool, notifier, "bench-warm", warm, interval).await?;
    wait_for_arrivals(arrivals, warm).await;
    for a in arrivals {
        a.lock().expect("not poisoned").clear();
    }
    Ok(())
}

/// The p99 latency (ms) of the events committed in each second of the run, in order.
fn p99_by_second(
    by_commit: &[(&Instant, &String)],
    arrivals: &HashMap<String, Instant>,
) -> Vec<String> {
    let Some(&(start, _)) = by_commit.first() else {
        return Vec::new();
    };
    let mut seconds: Vec<Vec<f64>> = Vec::new();
    for &(committed, id) in by_commit {
        let Some(at) = arrivals.get(id) else { continue };
        let second = committed.saturating_duration_since(*start).as_secs() as usize;
        if seconds.len() <= second {
            seconds.resize(second + 1, Vec::new());
        }
        seconds[second].push(latency_ms(committed, at));
    }
    seconds
        .iter_mut()
        .map(|l| {
            l.sort_by(f64::total_cmp);
            format!("{:.1}", percentile(l, 0.99))
        })
        .collect()
}

/// Waits until `n` events arrived at both the JetStream consumer and the webhook receiver, or
/// for [`DRAIN`] at most, saying every 5 s how many came.
async fn wait_for_arrivals(arrivals: [&Mutex<HashMap<String, Instant>>; 2], n: usize) {
    let deadline = Instant::now() + DRAIN;
    let mut last_print = Instant::now();
    loop {
        let [at_nats, at_hook] = arrivals.map(|a| a.lock().expect("not poisoned").len());
        if (at_nats >= n && at_hook >= n) || Instant::now() > deadline {
            return;
        }
        if last_print.elapsed() >= Duration::from_secs(5) {
            last_print = Instant::now();
            eprintln!(
                "  waiting: {at_nats}/{n} at the JetStream consumer, {at_hook}/{n} at the webhook"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sorted latencies in ms of every event that arrived.
fn latencies(commits: &HashMap<String, Instant>, arrivals: &HashMap<String, Instant>) -> Vec<f64> {
    let mut out: Vec<f64> = commits
        .iter()
        .filter_map(|(id, committed)| {
            let at = arrivals.get(id)?;
            Some(latency_ms(committed, at))
        })
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

/// Appends `n` single-event transactions, event `k` (stream `<streams>-<k>`) due at
/// `k × interval` from the start, from [`APPENDERS`] tasks; returns each event's commit time
/// by id.
async fn append_at_rate(
    pool: &PgPool,
    notifier: &Notifier,
    streams: &'static str,
    n: usize,
    interval: Duration,
) -> anyhow::Result<HashMap<String, Instant>> {
    let next = Arc::new(AtomicUsize::new(0));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..APPENDERS {
        let (pool, notifier, next) = (pool.clone(), notifier.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut commits = Vec::new();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= n {
                    return anyhow::Ok(commits);
                }
                tokio::time::sleep_until(start + interval.mul_f64(k as f64)).await;
                let event = NewEvent {
                    id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
                    event_type: EVENT_TYPE.into(),
                    data: json!({ "n": k, "state": "running", "tenantId": "bench",
                        "poolId": "pool_bench", "nodeId": "node_bench", "flavor": "bench-1" }),
                    metadata: Metadata {
                        tenant_id: Some("bench".into()),
                        actor: Some("id_bench".into()),
                        ..Metadata::default()
                    },
                };
                let id = event.id.clone();
                let mut tx = pool.begin().await?;
                append(
                    &mut tx,
                    &format!("{streams}-{k}"),
                    ExpectedVersion::NoStream,
                    &[event],
                )
                .await?;
                tx.commit().await?;
                commits.push((id, Instant::now()));
                notifier.committed();
            }
        }));
    }
    let mut commits = HashMap::with_capacity(n);
    for t in tasks {
        commits.extend(t.await??);
    }
    Ok(commits)
}

/// A pull consumer on the publisher's stream, for every `instance.*` event from the start.
async fn jetstream_consumer(url: &str) -> anyhow::Result<jetstream::consumer::PullConsumer> {
    let client = async_nats::connect(url).await.context("connect to NATS")?;
    let js = jetstream::new(client);
    let deadline = Instant::now() + Duration::from_secs(30);
    let stream = loop {
        match js.get_stream(STREAM).await {
            Ok(stream) => break stream,
            Err(e) if Instant::now() > deadline => {
                anyhow::bail!("the server's NATS publisher never created stream {STREAM}: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    stream
        .create_consumer(pull::Config {
            filter_subject: "instance.>".into(),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::None,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("create a JetStream consumer: {e}"))
}

/// Core NATS publish → subscribe latencies (ms, sorted) of `n` messages published every
/// `interval` on one connection and received on another.
async fn core_round_trips(url: &str, n: usize, interval: Duration) -> anyhow::Result<Vec<f64>> {
    let publisher = async_nats::connect(url).await.context("connect to NATS")?;
    let subscriber = async_nats::connect(url).await.context("connect to NATS")?;
    let mut subscription = subscriber.subscribe("bench.rtt").await?;
    subscriber.flush().await?;
    let sent: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; n]));
    let receiving = {
        let sent = sent.clone();
        tokio::spawn(async move {
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                let Some(message) = subscription.next().await else {
                    break;
                };
                let at = Instant::now();
                let k: usize = std::str::from_utf8(&message.payload[..16])
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(usize::MAX);
                if let Some(Some(t)) = sent.lock().expect("not poisoned").get(k) {
                    out.push(latency_ms(t, &at));
                }
            }
            out
        })
    };
    // About the size of a CloudEvent body.
    let padding = "x".repeat(400);
    let start = tokio::time::Instant::now();
    for k in 0..n {
        tokio::time::sleep_until(start + interval.mul_f64(k as f64)).await;
        let payload = format!("{k:>16}{padding}");
        sent.lock().expect("not poisoned")[k] = Some(Instant::now());
        publisher
            .publish("bench.rtt", payload.into_bytes().into())
            .await?;
    }
    publisher.flush().await?;
    let mut out = tokio::time::timeout(Duration::from_secs(30), receiving)
        .await
        .context("core NATS messages never arrived")??;
    out.sort_by(f64::total_cmp);
    Ok(out)
}

/// The webhook endpoint: answers 200 and records each `webhook-id`'s first arrival and how
/// many times it came.
#[derive(Clone)]
pub(crate) struct Receiver {
    pub(crate) url: String,
    pub(crate) arrivals: Arc<Mutex<HashMap<String, Instant>>>,
    /// When each request came, by `webhook-id`: more than one is a duplicate delivery.
    pub(crate) requests: Arc<Mutex<HashMap<String, Vec<Instant>>>>,
    pub(crate) secret: Arc<OnceLock<WebhookSecret>>,
    pub(crate) bad_signatures: Arc<AtomicUsize>,
}

impl Receiver {
    pub(crate) async fn start() -> anyhow::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let receiver = Receiver {
            url: format!("http://{}/hook", listener.local_addr()?),
            arrivals: Arc::default(),
            requests: Arc::default(),
            secret: Arc::default(),
            bad_signatures: Arc::default(),
        };
        let app = Router::new()
            .route("/hook", post(receive))
            .with_state(receiver.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(receiver)
    }
}

async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let at = Instant::now();
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    };
    let id = header("webhook-id");
    let signed = match (r.secret.get(), header("webhook-timestamp").parse::<i64>()) {
        (Some(secret), Ok(ts)) => {
            let body = std::str::from_utf8(&body).unwrap_or_default();
            let expected = vps_reactors::webhooks::signature::sign(secret, id, ts, body);
            header("webhook-signature")
                .split(' ')
                .any(|s| s == expected)
        }
        _ => false,
    };
    if !signed {
        r.bad_signatures.fetch_add(1, Ordering::Relaxed);
    }
    r.arrivals
        .lock()
        .expect("not poisoned")
        .entry(id.to_string())
        .or_insert(at);
    r.requests
        .lock()
        .expect("not poisoned")
        .entry(id.to_string())
        .or_default()
        .push(at);
    StatusCode::OK
}

/// A `nats-server -js` child on a free port with a temporary store, stopped and removed on drop.
pub(crate) struct NatsServer {
    binary: PathBuf,
    child: Option<Child>,
    port: u16,
    store: PathBuf,
}

impl NatsServer {
    pub(crate) fn start() -> anyhow::Result<NatsServer> {
        let binary = nats_server_binary().ok_or_else(|| {
            anyhow::anyhow!(
                "vps bench needs a nats-server binary: install it (Debian: apt-get install \
                 nats-server) or give its path in VPS_NATS_SERVER"
            )
        })?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let store = std::env::temp_dir().join(format!(
            "vps-bench-nats-{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        ));
        let mut server = NatsServer {
            binary,
            child: None,
            port,
            store,
        };
        server.restart()?;
        Ok(server)
    }

    /// Kills the server (its clients see the connection drop); [`NatsServer::restart`] brings
    /// it back on the same port and store.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server (again) on its port and store, and waits until it listens.
    pub(crate) fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let (binary, port) = (&self.binary, self.port);
        let mut child = Command::new(binary)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = child.try_wait()? {
                anyhow::bail!("{} exited at start: {status}", binary.display());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "nats-server did not listen on 127.0.0.1:{port} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
        Ok(())
    }

    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// `VPS_NATS_SERVER`, else `nats-server` on the PATH, else Debian's `/usr/sbin/nats-server`.
fn nats_server_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("VPS_NATS_SERVER") {
        let path = PathBuf::from(path);
        return path.exists().then_some(path);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let debian = Path::new("/usr/sbin/nats-server");
        debian.exists().then(|| debian.to_path_buf())
    })
}
