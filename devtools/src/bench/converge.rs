//! `vps bench converge`: `--instances` instances created over HTTP by 16 concurrent clients on
//! a hosted pool of `--hosts` emulated hosts, timed from the first create until every one is
//! `running`, with the server process's peak RSS. Baseline, same run and database: appending
//! as many `instance.created`-sized events with the log alone (16 writers, one event per
//! transaction), so the ratio says what the whole path (API, quota, placement, IP leases,
//! reconciler, node specs, host reports) costs over the bare log writes it makes.
//!
//! It gives up after `--timeout`: the figures then say how many instances were running, and
//! `vps` exits 1.
//!
//! The emulated hosts run in a child process (`vps bench converge-hosts`, the same binary), so
//! the server's peak RSS (`VmHWM` of this process) does not include them; the hosts' own peak
//! is reported separately. This process also holds the 16 HTTP clients and the progress
//! poller, which are small next to the server.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};
use sqlx::{PgPool, Row};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use vps_events::{append, ExpectedVersion, Metadata, NewEvent, Notifier};

use super::{round, run_writers, Creates, HostedServer, Rate, Scratch, Stop, TENANT};

/// Knobs.
#[derive(Debug, Clone)]
pub struct ConvergeBench {
    /// Nodes, one emulated host each.
    pub hosts: usize,
    /// Instances to create.
    pub instances: usize,
    /// How long an emulated domain boots.
    pub boot: Duration,
    /// Concurrent HTTP clients creating instances (and log writers in the baseline).
    pub clients: usize,
    /// Give up waiting for convergence after this long (the figures then say how far it got).
    pub timeout: Duration,
    /// The usage window, in seconds.
    pub usage_window: f64,
}

/// Runs the benchmark and prints the figures, JSON line last; returns whether every instance
/// ran before the timeout.
pub async fn run(server_url: &str, o: &ConvergeBench) -> anyhow::Result<bool> {
    // The server's pool, as `vps serve` sizes it, plus room for the progress poller.
    let scratch = Scratch::create(server_url, 32).await?;
    let result = phases(&scratch, o).await;
    scratch.drop_database().await?;
    let figures = result?;
    println!("{}", serde_json::to_string(&figures)?);
    Ok(figures["converged"] == json!(true))
}

async fn phases(scratch: &Scratch, o: &ConvergeBench) -> anyhow::Result<Value> {
    let (mut config, tenant_token) = super::server_config();
    // Fast enough that a transitional instance is looked at again within a second.
    config.timings.transitional_look = 1.0;
    config.timings.unschedulable_retry = 1.0;
    config.timings.usage_window = o.usage_window;

    let setup = Instant::now();
    // Nodes twice as big as their share, so placement never runs out of room.
    let share = o.instances.div_ceil(o.hosts) as u32;
    let spec = super::BenchPool {
        nodes: o.hosts,
        node_size: (share * 2).clamp(8, 4096),
        quota: (o.instances as u64 * 2).max(16),
    };
    let HostedServer {
        server,
        pool_id,
        nodes,
    } = HostedServer::start(&scratch.pool, config, &spec).await?;
    let url = server.url();
    println!(
        "setup: pool, flavor, image and {} nodes in {:.1} s",
        nodes.len(),
        setup.elapsed().as_secs_f64()
    );
    let rss_before_hosts = proc_status_kb("self", "VmRSS").unwrap_or(0);

    let mut hosts = match HostsProcess::start(&url, &nodes, o.boot).await {
        Ok(hosts) => hosts,
        Err(e) => {
            server.shutdown().await;
            return Err(e);
        }
    };
    // Let every host take its first spec before the clock starts.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let started = Instant::now();
    let progress = tokio::spawn(watch_progress(
        scratch.pool.clone(),
        started,
        o.instances,
        o.timeout,
    ));
    let created = create_instances(&url, &tenant_token, &pool_id, o, started + o.timeout).await;
    let created_seconds = started.elapsed().as_secs_f64();
    let progress = match created {
        Ok(errors) => {
            let count = vps_projections::instances::reads::count(&scratch.pool).await?;
            println!(
                "created {count} instances over HTTP in {created_seconds:.1} s ({:.0}/s, {} clients, {errors} retried errors)",
                count as f64 / created_seconds,
                o.clients
            );
            progress.await?
        }
        Err(e) => {
            progress.abort();
            let _ = hosts.stop().await;
            server.shutdown().await;
            return Err(e);
        }
    };
    let server_peak_kb = proc_status_kb("self", "VmHWM").unwrap_or(0);
    let hosts_peak_kb = hosts.peak_kb();
    hosts.stop().await?;

    let states = state_counts(&scratch.pool).await?;
    let counters = work_counters(&scratch.pool).await.unwrap_or_default();
    server.shutdown().await;

    let running = *states.get("running").unwrap_or(&0);
    let converge_seconds = progress.converged_after;
    match converge_seconds {
        Some(s) => println!(
            "all {} instances running after {s:.1} s ({:.0}/s)",
            o.instances,
            o.instances as f64 / s
        ),
        None => println!(
            "NOT converged: {running} of {} running after {:.0} s; states {states:?}",
            o.instances,
            o.timeout.as_secs_f64()
        ),
    }
    for (what, at) in &progress.milestones {
        println!("  {what:<28} {at:>7.1} s");
    }
    println!("  log and queue: {counters}");
    let mb = |kb: u64| round(kb as f64 / 1024.0, 1);
    println!(
        "server process RSS: {:.1} MB before hosts started, {:.1} MB peak (VmHWM; the emulated \
         hosts run in a child process: {:.1} MB peak)",
        mb(rss_before_hosts),
        mb(server_peak_kb),
        mb(hosts_peak_kb)
    );

    let template = created_event_template(&scratch.pool).await?;
    let baseline = baseline_appends(&scratch.pool, &template, o.instances, o.clients).await?;
    println!(
        "baseline: {} instance.created-sized single-event appends by {} writers in {:.2} s ({:.0}/s)",
        baseline.count,
        o.clients,
        baseline.seconds,
        baseline.per_second()
    );
    let ratio = converge_seconds.map(|c| c / baseline.seconds);
    if let Some(r) = ratio {
        println!("ratio converge/baseline: {r:.1}");
    }
    Ok(json!({
        "converged": converge_seconds.is_some(),
        "seconds": converge_seconds.map(|s| round(s, 2)),
        "running": running,
        "instances": o.instances,
        "hosts": o.hosts,
        "peak_rss_mb": mb(server_peak_kb),
        "baseline_append_seconds": round(baseline.seconds, 3),
        "append_tps": round(baseline.per_second(), 0),
        "ratio": ratio.map(|r| round(r, 2)),
        "timeout_seconds": o.timeout.as_secs_f64(),
        "create_seconds": round(created_seconds, 2),
        "rss_before_hosts_mb": mb(rss_before_hosts),
        "hosts_peak_rss_mb": mb(hosts_peak_kb),
        "boot_ms": o.boot.as_millis() as u64,
        "clients": o.clients,
        "usage_window_seconds": o.usage_window,
    }))
}

/// Creates every instance (or as many as it can before `deadline`) from `clients` concurrent
/// HTTP clients; returns how many calls had to be retried (connection errors or 5xx). Fails
/// on a 4xx or on an instance that cannot be created after a few tries.
async fn create_instances(
    url: &str,
    token: &str,
    pool_id: &str,
    o: &ConvergeBench,
    deadline: Instant,
) -> anyhow::Result<usize> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(o.clients)
        .timeout(Duration::from_secs(60))
        .build()?;
    let creates = Creates::new(http, url, token, pool_id);
    let next = Arc::new(AtomicUsize::new(0));
    let retried = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..o.clients {
        let (creates, next, retried) = (creates.clone(), next.clone(), retried.clone());
        let total = o.instances;
        tasks.push(tokio::spawn(async move {
            loop {
                if Instant::now() > deadline {
                    return anyhow::Ok(());
                }
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    return anyhow::Ok(());
                }
                let key = format!("bench-{n}");
                let mut tries = 0;
                loop {
                    tries += 1;
                    let answer = creates.send(&key).await;
                    let failure = match answer {
                        Ok(r) if r.status().is_success() => break,
                        Ok(r) if r.status().is_client_error() => {
                            let status = r.status();
                            let text = r.text().await.unwrap_or_default();
                            anyhow::bail!("instances.create #{n}: {status} {text}");
                        }
                        Ok(r) => format!("{} {}", r.status(), r.text().await.unwrap_or_default()),
                        Err(e) => e.to_string(),
                    };
                    retried.fetch_add(1, Ordering::Relaxed);
                    if tries >= 5 {
                        anyhow::bail!("instances.create #{n} failed {tries} times: {failure}");
                    }
                    tokio::time::sleep(Duration::from_millis(100 * tries)).await;
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(retried.load(Ordering::Relaxed))
}

/// What the progress poller saw.
struct Progress {
    converged_after: Option<f64>,
    milestones: Vec<(String, f64)>,
}

/// Counts instance states on the database every 200 ms (one cheap query, not one GET per
/// instance) until all are running or the timeout; prints a line every 5 s.
async fn watch_progress(
    pool: PgPool,
    started: Instant,
    instances: usize,
    timeout: Duration,
) -> Progress {
    let mut milestones = Vec::new();
    let mut last_print = Instant::now();
    let mut placed_all = false;
    let mut half = false;
    loop {
        let at = started.elapsed().as_secs_f64();
        if let Ok(states) = state_counts(&pool).await {
            let total: i64 = states.values().sum();
            let running = *states.get("running").unwrap_or(&0);
            let unplaced: i64 = ["pending", "scheduling"]
                .iter()
                .map(|s| *states.get(*s).unwrap_or(&0))
                .sum();
            if !placed_all && total as usize >= instances && unplaced == 0 {
                placed_all = true;
                milestones.push(("all created and placed".into(), at));
            }
            if !half && running as usize * 2 >= instances {
                half = true;
                milestones.push(("half running".into(), at));
            }
            if running as usize >= instances {
                milestones.push(("all running".into(), at));
                return Progress {
                    converged_after: Some(at),
                    milestones,
                };
            }
            if last_print.elapsed() >= Duration::from_secs(5) {
                last_print = Instant::now();
                eprintln!("  [{at:>6.1} s] {states:?}");
            }
        }
        if started.elapsed() > timeout {
            return Progress {
                converged_after: None,
                milestones,
            };
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn state_counts(pool: &PgPool) -> anyhow::Result<BTreeMap<String, i64>> {
    let rows = vps_projections::instances::reads::state_counts(pool).await?;
    Ok(rows.into_iter().collect())
}

/// Events in the log by kind, and reconcile passes (the work queue), for telling where the
/// time went.
async fn work_counters(pool: &PgPool) -> anyhow::Result<String> {
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await?;
    let by_type = sqlx::query(
        "SELECT type, count(*) FROM events WHERE type LIKE 'instance.%' OR type LIKE 'node.%'
          GROUP BY type ORDER BY count(*) DESC LIMIT 8",
    )
    .fetch_all(pool)
    .await?;
    let types: Vec<String> = by_type
        .iter()
        .map(|r| format!("{} {}", r.get::<String, _>(0), r.get::<i64, _>(1)))
        .collect();
    let passes = vps_api::telemetry::metrics_handle()
        .render()
        .lines()
        .filter(|l| {
            l.starts_with("vps_reconcile_passes_total")
                || l.starts_with("vps_reconcile_failures_total")
        })
        .map(|l| l.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Ok(format!("{events} events ({}); {passes}", types.join(", ")))
}

/// A real `instance.created` event's payload, to size the baseline's events like it.
async fn created_event_template(pool: &PgPool) -> anyhow::Result<(Value, Value)> {
    let row = sqlx::query(
        "SELECT data, metadata FROM events WHERE type = 'instance.created' ORDER BY position LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    Ok(match row {
        Some(r) => (r.try_get(0)?, r.try_get(1)?),
        None => (json!({ "state": "pending" }), json!({ "tenantId": TENANT })),
    })
}

/// `count` single-event transactions from `writers` writers, each event a new stream like an
/// instance's first event.
async fn baseline_appends(
    pool: &PgPool,
    template: &(Value, Value),
    count: usize,
    writers: usize,
) -> anyhow::Result<Rate> {
    let (data, metadata) = template.clone();
    let metadata: Metadata = serde_json::from_value(metadata).unwrap_or_default();
    let (pool, notifier) = (pool.clone(), Notifier::local_only());
    run_writers(writers, Stop::Total(count as u64), move |w, n| {
        let (pool, notifier) = (pool.clone(), notifier.clone());
        let event = NewEvent {
            id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
            event_type: "instance.created".into(),
            data: data.clone(),
            metadata: metadata.clone(),
        };
        async move {
            let mut tx = pool.begin().await?;
            let stream = format!("bench-baseline-{w}-{n}");
            append(&mut tx, &stream, ExpectedVersion::NoStream, &[event]).await?;
            tx.commit().await?;
            notifier.committed();
            Ok(1)
        }
    })
    .await
}

/// `Name:   123 kB` from `/proc/<pid>/status`, in kB.
fn proc_status_kb(pid: &str, name: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The emulated hosts, in a child `vps bench converge-hosts`.
struct HostsProcess {
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
}

impl HostsProcess {
    async fn start(url: &str, nodes: &[(String, String)], boot: Duration) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("the vps binary's path")?;
        let mut child = tokio::process::Command::new(exe)
            .args(["bench", "converge-hosts", "--url", url, "--boot-ms"])
            .arg(boot.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("start the emulated hosts' process")?;
        let mut stdin = child.stdin.take().context("hosts' stdin")?;
        let mut lines = String::new();
        for (node, token) in nodes {
            lines.push_str(&format!("{node} {token}\n"));
        }
        lines.push('\n');
        stdin.write_all(lines.as_bytes()).await?;
        stdin.flush().await?;
        let stdout = child.stdout.take().context("hosts' stdout")?;
        let mut ready = String::new();
        BufReader::new(stdout).read_line(&mut ready).await?;
        anyhow::ensure!(
            ready.trim() == "ready",
            "the emulated hosts' process did not start"
        );
        Ok(HostsProcess {
            child,
            stdin: Some(stdin),
        })
    }

    fn peak_kb(&self) -> u64 {
        self.child
            .id()
            .and_then(|pid| proc_status_kb(&pid.to_string(), "VmHWM"))
            .unwrap_or(0)
    }

    /// Closes its stdin (it exits on EOF), killing it if it lingers.
    async fn stop(&mut self) -> anyhow::Result<()> {
        drop(self.stdin.take());
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            self.child.kill().await?;
        }
        Ok(())
    }
}

/// The child side: reads `node token` lines (up to an empty line) from stdin, starts one
/// emulated host per node against `url`, prints `ready`, and runs until stdin closes.
pub async fn hosts_process(url: &str, boot: Duration) -> anyhow::Result<()> {
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    // Blocking stdin on its own thread; the channel closes at EOF.
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut handles = Vec::new();
    while let Some(line) = lines.recv().await {
        let Some((node, token)) = line.trim().split_once(' ') else {
            break;
        };
        let mut config = vps_emulators::host::HostConfig::new(url, node, token);
        config.boot_delay = boot;
        config.report_interval = Duration::from_secs(1);
        config.poll_wait = Duration::from_secs(5);
        handles.push(vps_emulators::host::EmulatedHost::start(config));
    }
    println!("ready");
    while lines.recv().await.is_some() {}
    drop(handles);
    Ok(())
}
