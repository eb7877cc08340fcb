//! `vps bench host --image FILE`: the real host's own overhead. On the `qemu` runtime (KVM when
//! a probe boot proves it works, TCG otherwise), with the real host agent in this process:
//! - cold: `instances.create` with `wait` until the control plane says `running`, beside QEMU
//!   alone started with the same arguments and waited on for the same signal the runtime waits
//!   for before it reports a guest running (its QMP socket answering, `query-status` running);
//! - warm: `sandboxes.create` with `wait` claiming a paused guest of a template's warm pool
//!   until `ready`, beside QMP `cont` of a paused QEMU alone.
//!
//! The figures that count are the differences: what the control plane and the agent add.
//! Beside them it shows where a sample's time went (the node's spec, the agent's boot steps,
//! the log's events) and, for scale, how long the guest takes to reach its init.
//!
//! Network safety: bridges, taps and guest addresses exist only in a network namespace this
//! bench makes. `vps bench host` (the parent) creates the scratch database and runs itself
//! again under `unshare --net` (`vps bench host-in-namespace`); the child brings `lo` up,
//! refuses to run in the machine's own namespace, and runs the server, the agent and every
//! QEMU there. The database is reached over a unix socket: the server's own when it has one
//! on this machine, else one the parent forwards to its TCP port. Every QEMU, tap and
//! directory is removed at the end, on error too: the child deletes what it made and kills
//! any QEMU left under its directory, and the parent does the same again after the child ends
//! (a tap ends with the namespace once no QEMU holds it).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use vps_domain::aggregate::Aggregate;
use vps_domain::instance::Instance;
use vps_domain::sandbox::Sandbox;
use vps_events::Notifier;
use vps_host::runtime::qemu::{Accel, Qemu};

use super::sandbox::Client;
use super::{median, round, single_appends, Scratch, FLAVOR, IMAGE, TENANT};
use vps_api::server::RunningServer;

/// Knobs.
#[derive(Debug, Clone)]
pub struct HostBench {
    /// The guest bundle (`vps images build minimal --out FILE`).
    pub image: PathBuf,
    /// Cold creates measured (each beside one QEMU boot alone).
    pub cold: usize,
    /// Warm claims measured (each beside one `cont` alone).
    pub warm: usize,
    /// The acceleration the runtime is configured with.
    pub accel: Accel,
    /// Memory snapshot-and-restore rounds (`vps bench snapshot --runtime qemu`): when not 0,
    /// these are measured instead of boots.
    pub snapshots: usize,
    /// The runtime's `restore_slots` (0: every memory restore starts its own QEMU).
    pub restore_slots: usize,
}

mod snapshot;

/// The targets of issue 38: reported, not asserted.
const COLD_TARGET_MS: f64 = 50.0;
const WARM_TARGET_MS: f64 = 20.0;
/// Where the parent hands the child the database URL (not on its command line: it may hold
/// a password).
const DATABASE_ENV: &str = "VPS_BENCH_HOST_DATABASE_URL";
/// The parent's network namespace, which the child must not be in.
const PARENT_NETNS_ENV: &str = "VPS_BENCH_HOST_PARENT_NETNS";
/// The pool's addresses, inside the bench's namespace only.
const CIDR: &str = "10.77.0.0/24";
const GATEWAY: &str = "10.77.0.1";
const BRIDGE: &str = "vpsbench0";
/// How long one boot to `running` (or to the guest's init) may take under TCG on a busy
/// machine before the bench gives up.
const BOOT_LIMIT: Duration = Duration::from_secs(120);
/// The console line the minimal guest prints when its init begins (docs/guest-contract.md).
const INIT_LINE: &str = "vps-init:";

/// The parent: makes the scratch database and the bench's directory, runs the measurement in
/// a network namespace of its own (a child `vps bench host-in-namespace` under `unshare
/// --net`), and cleans up after it whatever happened. Returns whether the child succeeded.
pub async fn run(server_url: &str, o: &HostBench) -> anyhow::Result<bool> {
    let image = std::fs::canonicalize(&o.image)
        .with_context(|| format!("the guest bundle {}", o.image.display()))?;
    // Short, so every QMP socket path fits beside its guest's files.
    let root = tempfile::Builder::new()
        .prefix("vps-bench-host-")
        .tempdir_in("/tmp")
        .context("the bench's directory under /tmp")?;
    let scratch = Scratch::create(server_url, 4).await?;
    let result = async {
        // What one commit costs on this server, for reading the figures: both paths commit
        // twice (the create or claim, the host's report) before they answer.
        let append_ms = scratch
            .beside(4, async |base| {
                let notifier = Notifier::start(base.pool.clone());
                let rate =
                    single_appends(&base.pool, &notifier, 1, Duration::from_secs(2), "single")
                        .await?;
                Ok(1000.0 / rate.per_second())
            })
            .await?;
        let (database, forward) = database_from_a_namespace(&scratch, root.path()).await?;
        let outcome = run_child(&database, &image, root.path(), append_ms, o).await;
        if let Some(forward) = forward {
            forward.abort();
        }
        outcome
    }
    .await;
    kill_qemus_under(root.path()).await;
    scratch.drop_database().await?;
    drop(root);
    result
}

/// Runs `vps bench host-in-namespace` under `unshare --net` with the child's knobs; its
/// standard output (the figures, JSON line last) is this command's.
async fn run_child(
    database: &str,
    image: &Path,
    root: &Path,
    append_ms: f64,
    o: &HostBench,
) -> anyhow::Result<bool> {
    let exe = std::env::current_exe().context("the vps binary's path")?;
    let netns = std::fs::read_link("/proc/self/ns/net").context("/proc/self/ns/net")?;
    let mut child = tokio::process::Command::new("unshare")
        .args(["--net", "--"])
        .arg(exe)
        .args(["bench", "host-in-namespace", "--image"])
        .arg(image)
        .arg("--root")
        .arg(root)
        .args(["--cold", &o.cold.to_string(), "--warm", &o.warm.to_string()])
        .args(["--snapshots", &o.snapshots.to_string()])
        .args(["--restore-slots", &o.restore_slots.to_string()])
        .args(["--accel", accel_name(o.accel)])
        .args(["--append-ms", &format!("{append_ms:.3}")])
        .env(DATABASE_ENV, database)
        .env(PARENT_NETNS_ENV, netns)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context(
            "start `unshare --net` (util-linux; needs root) for the bench's own network namespace",
        )?;
    let status = tokio::select! {
        status = child.wait() => status?,
        // The child got the same Ctrl-C and cleans up: give it the time to.
        _ = tokio::signal::ctrl_c() => {
            match tokio::time::timeout(Duration::from_secs(90), child.wait()).await {
                Ok(status) => status?,
                Err(_) => {
                    child.kill().await?;
                    child.wait().await?
                }
            }
        }
    };
    Ok(status.success())
}

/// A URL of the scratch database that works from another network namespace: a unix socket.
/// The server's own socket when it is on this machine, else one forwarded (by a task of this
/// process, in the machine's namespace) to the server's TCP port.
async fn database_from_a_namespace(
    scratch: &Scratch,
    root: &Path,
) -> anyhow::Result<(String, Option<tokio::task::JoinHandle<()>>)> {
    let url = url::Url::parse(&scratch.url).context("the scratch database's URL")?;
    if url
        .query_pairs()
        .any(|(k, v)| k == "host" && v.starts_with('/'))
    {
        return Ok((scratch.url.clone(), None));
    }
    let local = matches!(
        url.host_str(),
        Some("localhost" | "127.0.0.1" | "::1" | "[::1]")
    );
    if local {
        let dirs: String = sqlx::query_scalar("SELECT current_setting('unix_socket_directories')")
            .fetch_one(&scratch.pool)
            .await?;
        let port: String = sqlx::query_scalar("SELECT current_setting('port')")
            .fetch_one(&scratch.pool)
            .await?;
        for dir in dirs
            .split(',')
            .map(str::trim)
            .filter(|d| d.starts_with('/'))
        {
            if !Path::new(dir).join(format!(".s.PGSQL.{port}")).exists() {
                continue;
            }
            let candidate = with_socket(&url, dir, &port);
            use sqlx::Connection;
            if let Ok(conn) = sqlx::PgConnection::connect(&candidate).await {
                let _ = conn.close().await;
                return Ok((candidate, None));
            }
        }
    }
    let target = format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(5432)
    );
    let dir = root.join("pg");
    std::fs::create_dir_all(&dir)?;
    let listener = tokio::net::UnixListener::bind(dir.join(".s.PGSQL.5432"))
        .context("the database socket forwarded into the bench's namespace")?;
    let forward = tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(&target).await {
                    let _ = server.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Ok((
        with_socket(&url, &dir.to_string_lossy(), "5432"),
        Some(forward),
    ))
}

fn with_socket(url: &url::Url, dir: &str, port: &str) -> String {
    let mut url = url.clone();
    url.query_pairs_mut()
        .append_pair("host", dir)
        .append_pair("port", port);
    url.to_string()
}

/// The child, in its own network namespace: brings `lo` up, starts the server, the pool and
/// the agent, measures, prints the figures (JSON line last) and removes everything it made.
pub async fn in_namespace(o: &HostBench, root: &Path, append_ms: f64) -> anyhow::Result<()> {
    ensure_own_namespace().await?;
    command("ip", &["link", "set", "lo", "up"]).await?;
    let database = std::env::var(DATABASE_ENV)
        .with_context(|| format!("{DATABASE_ENV} (set by `vps bench host`)"))?;
    let pool = vps_events::connect(
        &database,
        &vps_events::DbOptions {
            max_connections: 40,
        },
    )
    .await
    .context("connect to the scratch database over its unix socket")?;
    let lab = match Lab::start(pool.clone(), root, o).await {
        Ok(lab) => lab,
        Err(e) => {
            kill_qemus_under(root).await;
            pool.close().await;
            return Err(e);
        }
    };
    let figures = async {
        match o.snapshots {
            0 => measure(&lab, o, append_ms).await,
            rounds => snapshot::measure(&lab, rounds).await,
        }
    };
    let outcome = tokio::select! {
        figures = figures => figures,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    lab.teardown().await;
    pool.close().await;
    let figures = outcome?;
    println!("{}", serde_json::to_string(&figures)?);
    Ok(())
}

/// Refuses to touch links unless this process runs in a network namespace that is not its
/// parent's (the machine's) and that holds nothing but `lo`: one just made for it.
async fn ensure_own_namespace() -> anyhow::Result<()> {
    let ours = std::fs::read_link("/proc/self/ns/net").context("/proc/self/ns/net")?;
    let parent = std::env::var(PARENT_NETNS_ENV)
        .with_context(|| format!("{PARENT_NETNS_ENV} (set by `vps bench host`)"))?;
    anyhow::ensure!(
        ours.to_string_lossy() != parent,
        "bench host-in-namespace runs only in a network namespace of its own (run `vps bench host`)"
    );
    let links = tokio::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .await
        .context("running ip")?;
    let names: Vec<String> = String::from_utf8_lossy(&links.stdout)
        .lines()
        .filter_map(|l| l.split(':').nth(1).map(|n| n.trim().to_string()))
        .collect();
    anyhow::ensure!(
        links.status.success() && names == ["lo"],
        "the bench's network namespace is not a fresh one (links: {names:?})"
    );
    Ok(())
}

/// The server, its qemu pool and one real host agent, all in this namespace.
struct Lab {
    server: RunningServer,
    host: Option<vps_host::HostHandle>,
    db: PgPool,
    client: Client,
    node_id: String,
    node_token: String,
    pool_id: String,
    state_dir: PathBuf,
    root: PathBuf,
    accel: &'static str,
    timings: vps_host::AgentTimings,
}

impl Lab {
    async fn start(db: PgPool, root: &Path, o: &HostBench) -> anyhow::Result<Lab> {
        let (mut config, token) = super::server_config();
        // As `vps dev` paces them: a claimed guest's refill starts within seconds.
        config.timings.transitional_look = 2.0;
        config.timings.unschedulable_retry = 5.0;
        config.timings.sandbox_pass = 2.0;
        let server = vps_api::server::start(config, db.clone()).await?;
        let ctx = vps_api::server::reactor_ctx(&server.state, "bench");
        let setup = async {
            let state_dir = root.join("state");
            let mut runtime = Qemu::new(&state_dir, root.join("images"), o.accel)?;
            runtime.restore_slots = o.restore_slots;
            // Decided once, before any guest: `auto` boots a probe under KVM and falls back.
            // The node is registered with the CPU model guests run with (memory restores).
            let chosen = runtime.chosen_accel().await;
            let cpu_model = vps_host::runtime::qemu::cpu_model_of(chosen);
            let (pool_id, node_id, node_token) =
                setup_qemu_pool(&ctx, &o.image, &cpu_model).await?;
            let timings = vps_host::AgentTimings::default();
            let config = vps_host::HostConfig {
                server_url: server.url(),
                node_id: node_id.clone(),
                node_token: node_token.clone(),
                state_dir: state_dir.clone(),
                image_dir: root.join("images"),
                bridge: Some(BRIDGE.into()),
                tunnel_listen: "127.0.0.1:0".into(),
                runtime: vps_host::RuntimeKind::Qemu,
                accel: o.accel,
                metrics_listen: None,
                dns_upstream: None,
                image_cache_max_bytes: None,
                restore_slots: None,
                timings: timings.clone(),
            };
            let host = vps_host::start(config, runtime).await?;
            anyhow::Ok((
                pool_id, node_id, node_token, state_dir, chosen, host, timings,
            ))
        };
        match setup.await {
            Ok((pool_id, node_id, node_token, state_dir, chosen, host, timings)) => Ok(Lab {
                client: Client {
                    http: reqwest::Client::builder().no_proxy().build()?,
                    url: server.url(),
                    token,
                },
                server,
                host: Some(host),
                db,
                node_id,
                node_token,
                pool_id,
                state_dir,
                root: root.to_path_buf(),
                accel: chosen.as_str(),
                timings,
            }),
            Err(e) => {
                server.shutdown().await;
                Err(e)
            }
        }
    }

    /// The first create, which fetches and unpacks the image (never a sample), and the
    /// baseline made from its QEMU's command line; the instance is deleted again.
    async fn first_create(&self) -> anyhow::Result<(ColdSample, BaselineTemplate)> {
        let first = cold_create(self, "first").await?;
        let template = BaselineTemplate::of(
            &self.guest_dir(&first.instance),
            &self.root.join("baseline-config.img"),
        )?;
        self.client
            .call(
                "instances.delete",
                json!({ "tenantId": TENANT, "instanceId": first.instance }),
            )
            .await?;
        self.await_deleted(&first.instance).await?;
        Ok((first, template))
    }

    fn guest_dir(&self, instance: &str) -> PathBuf {
        self.state_dir.join("guests").join(instance)
    }

    /// Deletes every sandbox, template and instance, waits (a minute at most) until the agent
    /// has removed their guests, stops the agent and the server, and kills any QEMU left.
    async fn teardown(mut self) {
        let tidy = async {
            let sandboxes = vps_projections::sandboxes::open_ids(&self.db).await?;
            for id in sandboxes {
                let body = json!({ "tenantId": TENANT, "sandboxId": id });
                let _ = self.client.call("sandboxes.delete", body).await;
            }
            let templates = vps_projections::sandboxes::live_template_ids(&self.db).await?;
            for id in templates {
                let body = json!({ "tenantId": TENANT, "templateId": id });
                let _ = self.client.call("sandboxTemplates.delete", body).await;
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let live = vps_projections::instances::reads::live_with_template(&self.db).await?;
                if live.is_empty() || Instant::now() > deadline {
                    break;
                }
                // Warm guests go with their template.
                for (id, _) in live.iter().filter(|(_, warm)| warm.is_none()) {
                    let body = json!({ "tenantId": TENANT, "instanceId": id });
                    let _ = self.client.call("instances.delete", body).await;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            anyhow::Ok(())
        };
        if let Err(e) = tidy.await {
            eprintln!("cleanup through the API failed ({e:#}); killing what is left");
        }
        if let Some(host) = self.host.take() {
            host.stop().await;
        }
        kill_qemus_under(&self.root).await;
        self.server.shutdown().await;
    }

    /// The node's spec generation now, and which instances it wants running.
    async fn node_spec(&self, after: Option<u64>, wait_ms: u64) -> anyhow::Result<Value> {
        node_spec(
            &self.client.http,
            &self.server.url(),
            &self.node_id,
            &self.node_token,
            after,
            wait_ms,
        )
        .await
    }

    /// A task that long-polls the node's spec (as a second reader beside the agent's own poll)
    /// and answers when an instance appears in it with `desiredState: running` that was not
    /// wanted running before: when the node could first know of a create or a claim.
    async fn spec_watch(&self) -> anyhow::Result<tokio::task::JoinHandle<Option<Instant>>> {
        let now = self.node_spec(None, 0).await?;
        let mut after = now["generation"].as_u64();
        let before: HashSet<String> = running_ids(&now);
        let (http, url, node, token) = (
            self.client.http.clone(),
            self.server.url(),
            self.node_id.clone(),
            self.node_token.clone(),
        );
        Ok(tokio::spawn(async move {
            loop {
                let spec = node_spec(&http, &url, &node, &token, after, 30_000)
                    .await
                    .ok()?;
                if running_ids(&spec).difference(&before).next().is_some() {
                    return Some(Instant::now());
                }
                after = spec["generation"].as_u64();
            }
        }))
    }

    /// Waits until `instance` is `deleted` (its guest removed by the agent).
    async fn await_deleted(&self, instance: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let state = vps_projections::instances::reads::state(&self.db, instance).await?;
            if state.as_deref() == Some("deleted") {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "instance {instance} is still {state:?} a minute after its delete"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the warm pool of `template` holds a paused guest and nothing else is on its
    /// way (no boot competing with the next claim for the CPU).
    async fn await_quiet_warm_pool(&self, template: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + BOOT_LIMIT;
        loop {
            let (paused, busy) =
                vps_projections::instances::reads::warm_paused_and_busy(&self.db, template).await?;
            if paused >= 1 && busy == 0 {
                // Let the agent's report of the pause and its next spec poll settle.
                tokio::time::sleep(Duration::from_millis(500)).await;
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the warm pool holds {paused} paused guests and {busy} instances are on their way after {BOOT_LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `nodes.spec` as the node.
async fn node_spec(
    http: &reqwest::Client,
    url: &str,
    node: &str,
    token: &str,
    after: Option<u64>,
    wait_ms: u64,
) -> anyhow::Result<Value> {
    let mut body = json!({ "nodeId": node, "waitMs": wait_ms });
    if let Some(after) = after {
        body["afterGeneration"] = after.into();
    }
    let response = http
        .post(format!("{url}/api/compute/nodes/spec"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await?;
    let status = response.status();
    let answer: Value = response.json().await?;
    anyhow::ensure!(
        status.is_success(),
        "nodes.spec answered {status}: {answer}"
    );
    Ok(answer)
}

/// When the spec watch saw the change (it has two seconds more after the answer), ending it.
async fn spec_served(mut watch: tokio::task::JoinHandle<Option<Instant>>) -> Option<Instant> {
    let seen = tokio::time::timeout(Duration::from_secs(2), &mut watch).await;
    watch.abort();
    seen.ok()?.ok()?
}

fn running_ids(spec: &Value) -> HashSet<String> {
    spec["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["desiredState"] == "running")
        .filter_map(|i| i["id"].as_str().map(str::to_owned))
        .collect()
}

/// A `qemu` pool with [`CIDR`], offered to [`TENANT`], with [`FLAVOR`] (1 vCPU, 1 GiB, 1 GiB
/// disk), the bundle registered as [`IMAGE`] by its `file://` path and digest, and one node
/// that runs `qemu`. Returns the pool's id and the node's id and token.
async fn setup_qemu_pool(
    ctx: &vps_commands::Ctx,
    image: &Path,
    cpu_model: &str,
) -> anyhow::Result<(String, String, String)> {
    use vps_commands::operator::{self as ops, RegisterImage, RegisterNode};
    let range = super::BenchRange {
        name: "bench-qemu",
        runtime: Some("qemu"),
        cidr: CIDR,
        gateway: Some(GATEWAY),
        quota: 1000,
    };
    let pool_id = super::pool_with_flavor(ctx, &range).await?;
    let bytes = tokio::fs::read(image)
        .await
        .with_context(|| format!("reading {}", image.display()))?;
    ops::register_image(
        ctx,
        RegisterImage {
            image_id: IMAGE.into(),
            tenant_id: None,
            url: format!("file://{}", image.display()),
            sha256: data_encoding::HEXLOWER.encode(&Sha256::digest(&bytes)),
            format: "bundle".into(),
            verified: true,
        },
    )
    .await?;
    let registered = ops::register_node(
        ctx,
        RegisterNode {
            pool_id: pool_id.parse()?,
            name: "bench-qemu-0".into(),
            // Room for a few guests at once (a warm one, a claimed one, a refill); the agent
            // itself refuses a guest larger than the machine.
            capacity: vps_domain::resources::Capacity {
                vcpu: 8,
                memory_gib: 16,
                disk_gib: 64,
                gpus: vec![],
            },
            labels: Default::default(),
            runtimes: Some(vec!["qemu".into()]),
            cpu_model: Some(cpu_model.into()),
        },
    )
    .await?;
    Ok((pool_id, registered.node.id, registered.node_token))
}

/// Milestones of one sample: milliseconds after the request was sent.
type Milestones = BTreeMap<String, f64>;

/// Files QEMU itself creates early in its start, beside the guest's others, and the milestone
/// each one's birth marks: they tell the runtime's way of starting QEMU from QEMU's own start.
const QEMU_FILES: [(&str, &str); 2] = [
    ("qemu.pid", "QEMU wrote its pid file"),
    ("qmp.sock", "QEMU made its QMP socket"),
];

/// Every phase, then the figures (printed) and the JSON line's value.
async fn measure(lab: &Lab, o: &HostBench, append_ms: f64) -> anyhow::Result<Value> {
    println!(
        "accel: {} (configured {}); node {}, state under {}",
        lab.accel,
        accel_name(o.accel),
        lab.node_id,
        lab.root.display()
    );

    let (first, template) = lab.first_create().await?;
    println!(
        "first create to running (image fetched and unpacked): {:.1} ms",
        first.total_ms
    );

    // Cold, each create beside one boot of QEMU alone, alternated so both see the same machine.
    let mut cold = Vec::new();
    let mut qemu_boot = Vec::new();
    let mut cold_init = Vec::new();
    let mut qemu_init = Vec::new();
    let mut cold_steps: Vec<Milestones> = Vec::new();
    let mut boot_steps: Vec<Milestones> = Vec::new();
    for i in 0..o.cold {
        let sample = cold_create(lab, &format!("cold-{i}")).await?;
        cold.push(sample.total_ms);
        if let Some(ms) = sample.init_ms {
            cold_init.push(ms);
        }
        cold_steps.push(sample.steps);
        lab.client
            .call(
                "instances.delete",
                json!({ "tenantId": TENANT, "instanceId": sample.instance }),
            )
            .await?;
        lab.await_deleted(&sample.instance).await?;

        let boot = template
            .boot(&lab.root.join(format!("baseline-{i}")))
            .await?;
        println!(
            "  cold {i}: create to running {:.1} ms (guest init at {}); QEMU alone to running {:.1} ms (init at {})",
            sample.total_ms,
            show(sample.init_ms),
            boot.running_ms,
            show(boot.init_ms)
        );
        qemu_boot.push(boot.running_ms);
        boot_steps.push(boot.steps);
        if let Some(ms) = boot.init_ms {
            qemu_init.push(ms);
        }
    }

    // Warm: a template whose pool keeps one paused guest, refilled between claims.
    let template_id = lab.client.template(&lab.pool_id, "warm", Some(1)).await?;
    let mut warm = Vec::new();
    let mut warm_steps: Vec<Milestones> = Vec::new();
    for i in 0..o.warm {
        lab.await_quiet_warm_pool(&template_id).await?;
        let sample = warm_claim(lab, &template_id, &format!("warm-{i}")).await?;
        println!("  warm {i}: claim to ready {:.1} ms", sample.total_ms);
        warm.push(sample.total_ms);
        warm_steps.push(sample.steps);
        lab.client
            .call(
                "sandboxes.delete",
                json!({ "tenantId": TENANT, "sandboxId": sample.sandbox }),
            )
            .await?;
        lab.await_deleted(&sample.instance).await?;
    }
    lab.client
        .call(
            "sandboxTemplates.delete",
            json!({ "tenantId": TENANT, "templateId": template_id }),
        )
        .await?;
    let qemu_cont = template
        .cont(&lab.root.join("baseline-cont"), o.warm)
        .await?;

    let cold_p50 = median(&cold);
    let boot_p50 = median(&qemu_boot);
    let warm_p50 = median(&warm);
    let cont_p50 = median(&qemu_cont);
    let cold_overhead = cold_p50 - boot_p50;
    let warm_overhead = warm_p50 - cont_p50;
    println!(
        "cold create to running: p50 {cold_p50:.1} ms ({} creates, {})",
        cold.len(),
        range(&cold)
    );
    println!(
        "  QEMU alone, same arguments, to QMP running: p50 {boot_p50:.1} ms ({})",
        range(&qemu_boot)
    );
    println!(
        "  overhead p50 {cold_overhead:.1} ms (target ≤ {COLD_TARGET_MS} ms: {})",
        verdict(cold_overhead, COLD_TARGET_MS)
    );
    println!("  where a cold create's time goes (p50 of each milestone, ms after the request):");
    print_steps(&cold_steps);
    println!("  and QEMU alone's (ms after its spawn):");
    print_steps(&boot_steps);
    println!(
        "  for scale: the guest's init begins {:.0} ms after the request (QEMU alone: {:.0} ms after its start)",
        median(&cold_init),
        median(&qemu_init)
    );
    println!(
        "warm claim to ready: p50 {warm_p50:.1} ms ({} claims, {})",
        warm.len(),
        range(&warm)
    );
    println!(
        "  QMP cont of a paused QEMU alone: p50 {cont_p50:.2} ms ({})",
        range(&qemu_cont)
    );
    println!(
        "  overhead p50 {warm_overhead:.1} ms (target ≤ {WARM_TARGET_MS} ms: {})",
        verdict(warm_overhead, WARM_TARGET_MS)
    );
    println!("  where a warm claim's time goes (p50 of each milestone, ms after the request):");
    print_steps(&warm_steps);
    println!(
        "one commit on this database (single-event append, 1 writer): {append_ms:.2} ms; a cold create and a warm claim each commit twice before they answer"
    );
    let t = &lab.timings;
    println!(
        "agent timings: report interval {:?}, spec long poll {:?}, look every {:?}",
        t.report_interval, t.poll_wait, t.observe_interval
    );

    let rounded = |v: &[f64]| v.iter().map(|x| round(*x, 1)).collect::<Vec<_>>();
    Ok(json!({
        "cold_p50_ms": round(cold_p50, 1),
        "qemu_boot_p50_ms": round(boot_p50, 1),
        "cold_overhead_p50_ms": round(cold_overhead, 1),
        "warm_p50_ms": round(warm_p50, 1),
        "qemu_cont_p50_ms": round(cont_p50, 2),
        "warm_overhead_p50_ms": round(warm_overhead, 1),
        "accel": lab.accel,
        "cold_ms": rounded(&cold),
        "qemu_boot_ms": rounded(&qemu_boot),
        "warm_ms": rounded(&warm),
        "qemu_cont_ms": qemu_cont.iter().map(|x| round(*x, 2)).collect::<Vec<_>>(),
        "cold_init_p50_ms": round(median(&cold_init), 0),
        "qemu_init_p50_ms": round(median(&qemu_init), 0),
        "first_create_ms": round(first.total_ms, 1),
        "append_ms": round(append_ms, 3),
        "cold_steps_p50_ms": steps_p50(&cold_steps),
        "qemu_boot_steps_p50_ms": steps_p50(&boot_steps),
        "warm_steps_p50_ms": steps_p50(&warm_steps),
        "cold_target_ms": COLD_TARGET_MS,
        "warm_target_ms": WARM_TARGET_MS,
    }))
}

/// One `instances.create` to `running`.
struct ColdSample {
    instance: String,
    total_ms: f64,
    /// When the guest's init began (its console), after the request.
    init_ms: Option<f64>,
    steps: Milestones,
}

async fn cold_create(lab: &Lab, key: &str) -> anyhow::Result<ColdSample> {
    let watch = lab.spec_watch().await?;
    let run_ops = operation_seconds("run");
    let wall = SystemTime::now();
    let started = Instant::now();
    let answer = lab
        .client
        .call(
            "instances.create",
            json!({ "tenantId": TENANT, "poolId": lab.pool_id, "flavor": FLAVOR,
                    "imageId": IMAGE, "idempotencyKey": key,
                    "wait": { "timeoutMs": 30000 } }),
        )
        .await?;
    let total_ms = ms(started.elapsed());
    let instance = answer["id"].as_str().unwrap_or_default().to_string();
    anyhow::ensure!(
        answer["state"] == "running",
        "instance {instance} is {} after its create's wait: {answer}",
        answer["state"]
    );
    let mut steps = Milestones::new();
    steps.insert("answer".into(), total_ms);
    if let Some(at) = spec_served(watch).await {
        steps.insert("spec served to the node".into(), ms(at - started));
    }
    let dir = lab.guest_dir(&instance);
    // The runtime writes the guest's record first when it begins a boot, then makes the disk
    // (`qemu-img create`, which creates the file once it has started), then the config drive,
    // then the taps, and writes `started-at` just before it spawns QEMU.
    let boot_began = modified_after(&dir.join("spec.json"), wall);
    if let Some(at) = boot_began {
        steps.insert("agent begins the boot".into(), at);
    }
    if let Some(at) = created_after(&dir.join("disk.qcow2"), wall) {
        steps.insert("disk file created by qemu-img".into(), at);
    }
    if let Some(at) = created_after(&dir.join("config.img"), wall) {
        steps.insert("config drive begun".into(), at);
    }
    if let Some(at) = modified_after(&dir.join("config.img"), wall) {
        steps.insert("config drive written (before its fsync)".into(), at);
    }
    if let Some(at) = started_at_after(&dir, wall) {
        steps.insert("QEMU spawned (setsid sh run.sh)".into(), at);
    }
    for (file, name) in QEMU_FILES {
        if let Some(at) = created_after(&dir.join(file), wall) {
            steps.insert(name.into(), at);
        }
    }
    if let Some(seconds) = delta(run_ops, operation_seconds("run")) {
        steps.insert(
            "(duration) the agent's run operation".into(),
            seconds * 1000.0,
        );
    }
    events_into(&lab.db, &[Instance::stream(&instance)], wall, &mut steps).await?;
    let init_ms = wait_for_console(&dir.join("console.log"), INIT_LINE, BOOT_LIMIT)
        .await
        .map(|at| ms(at - started));
    Ok(ColdSample {
        instance,
        total_ms,
        init_ms,
        steps,
    })
}

/// One warm `sandboxes.create` to `ready`.
struct WarmSample {
    sandbox: String,
    instance: String,
    total_ms: f64,
    steps: Milestones,
}

async fn warm_claim(lab: &Lab, template: &str, key: &str) -> anyhow::Result<WarmSample> {
    let watch = lab.spec_watch().await?;
    let run_ops = operation_seconds("run");
    let wall = SystemTime::now();
    let started = Instant::now();
    let answer = lab
        .client
        .call(
            "sandboxes.create",
            json!({ "tenantId": TENANT, "templateId": template, "ttlSeconds": 600,
                    "idempotencyKey": key, "wait": { "timeoutMs": 30000 } }),
        )
        .await?;
    let total_ms = ms(started.elapsed());
    let sandbox = answer["id"].as_str().unwrap_or_default().to_string();
    anyhow::ensure!(
        answer["state"] == "ready" && answer["warm"] == true,
        "sandbox {sandbox} is {} (warm {}) after its create's wait: {answer}",
        answer["state"],
        answer["warm"]
    );
    let instance = answer["instanceId"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut steps = Milestones::new();
    steps.insert("answer".into(), total_ms);
    if let Some(at) = spec_served(watch).await {
        steps.insert("spec served to the node".into(), ms(at - started));
    }
    if let Some(seconds) = delta(run_ops, operation_seconds("run")) {
        steps.insert(
            "(duration) the agent's run operation (cont)".into(),
            seconds * 1000.0,
        );
    }
    let streams = [Instance::stream(&instance), Sandbox::stream(&sandbox)];
    events_into(&lab.db, &streams, wall, &mut steps).await?;
    Ok(WarmSample {
        sandbox,
        instance,
        total_ms,
        steps,
    })
}

/// The first time each event type of `streams` was recorded after `since` (its transaction's
/// start), as `event <type>`.
async fn events_into(
    db: &PgPool,
    streams: &[String],
    since: SystemTime,
    steps: &mut Milestones,
) -> anyhow::Result<()> {
    let since_utc: DateTime<Utc> = since.into();
    let rows: Vec<(String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT type, recorded_at FROM events WHERE stream = ANY($1) AND recorded_at >= $2
          ORDER BY position",
    )
    .bind(streams)
    .bind(since_utc)
    .fetch_all(db)
    .await?;
    for (kind, at) in rows {
        let after = (at - since_utc).num_microseconds().unwrap_or(0) as f64 / 1000.0;
        steps.entry(format!("event {kind}")).or_insert(after);
    }
    Ok(())
}

/// Each milestone's p50 over the samples that have it, earliest first.
fn steps_p50(samples: &[Milestones]) -> Value {
    let mut by_name: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for sample in samples {
        for (name, at) in sample {
            by_name.entry(name).or_default().push(*at);
        }
    }
    let mut rows: Vec<(&str, f64)> = by_name.into_iter().map(|(n, v)| (n, median(&v))).collect();
    rows.sort_by(|a, b| a.1.total_cmp(&b.1));
    Value::Object(
        rows.into_iter()
            .map(|(n, v)| (n.to_string(), json!(round(v, 1))))
            .collect(),
    )
}

fn print_steps(samples: &[Milestones]) {
    if let Value::Object(rows) = steps_p50(samples) {
        for (name, at) in rows {
            println!("    {at:>9} ms  {name}");
        }
    }
}

/// QEMU alone, started exactly as the runtime started the first guest: its command line, read
/// from the process, with the guest's directory and tap replaced by the baseline's own.
struct BaselineTemplate {
    binary: String,
    args: Vec<String>,
    guest_dir: String,
    config_drive: PathBuf,
    disk_size: String,
}

/// One boot of QEMU alone.
struct BaselineBoot {
    /// Spawn to QMP answering with the VM `running`: what the runtime waits for.
    running_ms: f64,
    /// Spawn to the guest's init on the console.
    init_ms: Option<f64>,
    /// Spawn to QEMU's own files ([`QEMU_FILES`]) and to `running`.
    steps: Milestones,
}

impl BaselineTemplate {
    /// Reads the command line of the QEMU of the guest in `guest_dir` and keeps a copy of its
    /// config drive at `config_copy`.
    fn of(guest_dir: &Path, config_copy: &Path) -> anyhow::Result<Self> {
        let pid: i32 = std::fs::read_to_string(guest_dir.join("qemu.pid"))
            .context("the first guest's QEMU pid file")?
            .trim()
            .parse()
            .context("the first guest's QEMU pid")?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
            .with_context(|| format!("the first guest's QEMU (pid {pid}) command line"))?;
        let mut argv: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        anyhow::ensure!(!argv.is_empty(), "QEMU (pid {pid}) has no command line");
        let binary = argv.remove(0);
        std::fs::copy(guest_dir.join("config.img"), config_copy)
            .context("copying the first guest's config drive")?;
        Ok(BaselineTemplate {
            binary,
            args: argv,
            guest_dir: guest_dir.to_string_lossy().into_owned(),
            config_drive: config_copy.to_path_buf(),
            disk_size: "1G".into(),
        })
    }

    /// The arguments for a QEMU in `dir`: every path of the guest's directory moved there, the
    /// QMP socket there too, and a tap of its own (QEMU makes it, unattached).
    fn args_for(&self, dir: &Path, tap: &str) -> Vec<String> {
        let dir_text = dir.to_string_lossy();
        let mut args: Vec<String> = self
            .args
            .iter()
            .map(|a| a.replace(&self.guest_dir, &dir_text))
            .collect();
        for i in 1..args.len() {
            if args[i - 1] == "-qmp" {
                args[i] = format!("unix:{},server=on,wait=off", dir.join("qmp.sock").display());
            }
            if args[i - 1] == "-netdev" && args[i].starts_with("tap,") {
                args[i] = args[i]
                    .split(',')
                    .map(|part| match part.strip_prefix("ifname=") {
                        Some(_) => format!("ifname={tap}"),
                        None => part.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join(",");
            }
        }
        args
    }

    /// A fresh directory with a blank disk and the first guest's config drive, as a boot
    /// finds them.
    async fn prepare(&self, dir: &Path) -> anyhow::Result<()> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        std::fs::copy(&self.config_drive, dir.join("config.img"))?;
        let disk = dir.join("disk.qcow2");
        command(
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                &disk.to_string_lossy(),
                &self.disk_size,
            ],
        )
        .await
    }

    fn spawn(&self, dir: &Path, tap: &str) -> anyhow::Result<tokio::process::Child> {
        let log = std::fs::File::create(dir.join("qemu.log"))?;
        tokio::process::Command::new(&self.binary)
            .args(self.args_for(dir, tap))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.binary))
    }

    /// One boot: spawn, QMP `running` (timed), then the guest's init (timed), then kill.
    async fn boot(&self, dir: &Path) -> anyhow::Result<BaselineBoot> {
        self.prepare(dir).await?;
        let wall = SystemTime::now();
        let started = Instant::now();
        let mut child = self.spawn(dir, "vpsbaseline0")?;
        let result = async {
            let mut qmp = Qmp::connect_when_up(&dir.join("qmp.sock"), BOOT_LIMIT).await?;
            loop {
                let status = qmp.execute("query-status").await?;
                if status["status"] == "running" {
                    break;
                }
                anyhow::ensure!(started.elapsed() < BOOT_LIMIT, "QEMU alone: {status}");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let running_ms = ms(started.elapsed());
            let mut steps = Milestones::new();
            steps.insert("QEMU spawned".into(), 0.0);
            for (file, name) in QEMU_FILES {
                if let Some(at) = created_after(&dir.join(file), wall) {
                    steps.insert(name.into(), at);
                }
            }
            steps.insert("QMP answers, VM running".into(), running_ms);
            let init_ms = wait_for_console(&dir.join("console.log"), INIT_LINE, BOOT_LIMIT)
                .await
                .map(|at| ms(at - started));
            anyhow::Ok(BaselineBoot {
                running_ms,
                init_ms,
                steps,
            })
        }
        .await;
        let _ = child.kill().await;
        let _ = std::fs::remove_dir_all(dir);
        result.with_context(|| format!("QEMU alone: {}", tail(&dir.join("qemu.log"))))
    }

    /// `count` timed QMP `cont`s of one QEMU alone, paused with `stop` a moment before each,
    /// once its guest has reached its init (a warm guest is paused later in its boot still).
    async fn cont(&self, dir: &Path, count: usize) -> anyhow::Result<Vec<f64>> {
        self.prepare(dir).await?;
        let mut child = self.spawn(dir, "vpsbaseline1")?;
        let result = async {
            let mut qmp = Qmp::connect_when_up(&dir.join("qmp.sock"), BOOT_LIMIT).await?;
            wait_for_console(&dir.join("console.log"), INIT_LINE, BOOT_LIMIT)
                .await
                .context("the guest never reached its init")?;
            let mut samples = Vec::with_capacity(count);
            for _ in 0..count {
                qmp.execute("stop").await?;
                tokio::time::sleep(Duration::from_millis(200)).await;
                let started = Instant::now();
                qmp.execute("cont").await?;
                samples.push(ms(started.elapsed()));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            anyhow::Ok(samples)
        }
        .await;
        let _ = child.kill().await;
        let _ = std::fs::remove_dir_all(dir);
        result.with_context(|| format!("QEMU alone: {}", tail(&dir.join("qemu.log"))))
    }
}

/// A bare QMP connection: the greeting, `qmp_capabilities`, then one command at a time
/// (events in between are skipped).
struct Qmp {
    lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
    writer: tokio::net::unix::OwnedWriteHalf,
}

impl Qmp {
    /// Connects as soon as the socket accepts (tried every millisecond until `limit`).
    async fn connect_when_up(path: &Path, limit: Duration) -> anyhow::Result<Qmp> {
        let deadline = Instant::now() + limit;
        let stream = loop {
            match tokio::net::UnixStream::connect(path).await {
                Ok(stream) => break stream,
                Err(e) if Instant::now() > deadline => {
                    anyhow::bail!("QMP socket {}: {e}", path.display())
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        };
        let (read, writer) = stream.into_split();
        let mut qmp = Qmp {
            lines: BufReader::new(read).lines(),
            writer,
        };
        let greeting = qmp.line().await?;
        anyhow::ensure!(
            greeting.get("QMP").is_some(),
            "not a QMP greeting: {greeting}"
        );
        qmp.execute("qmp_capabilities").await?;
        Ok(qmp)
    }

    async fn line(&mut self) -> anyhow::Result<Value> {
        let line = self
            .lines
            .next_line()
            .await?
            .context("QMP connection closed")?;
        Ok(serde_json::from_str(&line)?)
    }

    async fn execute(&mut self, command: &str) -> anyhow::Result<Value> {
        self.send(command, json!({ "execute": command })).await
    }

    async fn execute_with(&mut self, command: &str, arguments: Value) -> anyhow::Result<Value> {
        self.send(
            command,
            json!({ "execute": command, "arguments": arguments }),
        )
        .await
    }

    async fn send(&mut self, command: &str, request: Value) -> anyhow::Result<Value> {
        let request = format!("{request}\n");
        self.writer.write_all(request.as_bytes()).await?;
        loop {
            let message = self.line().await?;
            if let Some(answer) = message.get("return") {
                return Ok(answer.clone());
            }
            if let Some(error) = message.get("error") {
                anyhow::bail!("QMP {command}: {error}");
            }
        }
    }
}

/// Waits until `file` holds `needle`; when it first did (checked every 5 ms), or `None` after
/// `limit`.
async fn wait_for_console(file: &Path, needle: &str, limit: Duration) -> Option<Instant> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if std::fs::read(file)
            .map(|text| String::from_utf8_lossy(&text).contains(needle))
            .unwrap_or(false)
        {
            return Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// Kills every QEMU whose command line names a path under `root` and waits (briefly) until
/// they are gone: the last guard against a guest outliving the bench.
async fn kill_qemus_under(root: &Path) {
    let root = root.to_string_lossy().into_owned();
    let find = || -> Vec<String> {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let cmdline = String::from_utf8_lossy(&cmdline);
                let argv0 = cmdline.split('\0').next().unwrap_or_default();
                (argv0.contains("qemu-system") && cmdline.contains(&root)).then(|| pid.to_string())
            })
            .collect()
    };
    let pids = find();
    if pids.is_empty() {
        return;
    }
    eprintln!("killing {} QEMU process(es) left under {root}", pids.len());
    let mut args = vec!["-KILL"];
    args.extend(pids.iter().map(String::as_str));
    let _ = tokio::process::Command::new("kill")
        .args(&args)
        .status()
        .await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !find().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The sum of `vps_host_operation_seconds{operation}` in this process's metrics (the agent
/// runs here), and how many there were.
fn operation_seconds(operation: &str) -> Option<(f64, f64)> {
    let text = vps_api::telemetry::metrics_handle().render();
    let label = format!("operation=\"{operation}\"");
    let value = |suffix: &str| -> Option<f64> {
        text.lines()
            .find(|l| {
                l.starts_with(&format!("vps_host_operation_seconds_{suffix}")) && l.contains(&label)
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    Some((value("sum").unwrap_or(0.0), value("count").unwrap_or(0.0)))
}

/// The seconds of the one operation that ended between two readings.
fn delta(before: Option<(f64, f64)>, after: Option<(f64, f64)>) -> Option<f64> {
    let ((sum0, n0), (sum1, n1)) = (before?, after?);
    (n1 - n0 == 1.0).then_some(sum1 - sum0)
}

/// Milliseconds from `since` to the file's last modification, when it was modified after.
pub(super) fn modified_after(file: &Path, since: SystemTime) -> Option<f64> {
    let at = std::fs::metadata(file).ok()?.modified().ok()?;
    at.duration_since(since).ok().map(ms)
}

/// Milliseconds from `since` to the file's creation (its birth time), when it was made after.
fn created_after(file: &Path, since: SystemTime) -> Option<f64> {
    let at = std::fs::metadata(file).ok()?.created().ok()?;
    at.duration_since(since).ok().map(ms)
}

/// Milliseconds from `since` to the runtime's `started-at` (unix ms, just before it spawns).
fn started_at_after(dir: &Path, since: SystemTime) -> Option<f64> {
    let unix_ms: u64 = std::fs::read_to_string(dir.join("started-at"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(unix_ms);
    at.duration_since(since).ok().map(ms)
}

async fn command(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let output = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .with_context(|| format!("running {program}"))?;
    anyhow::ensure!(
        output.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(())
}

fn tail(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.len() {
        0 => "no output".into(),
        n => lines[n.saturating_sub(3)..].join(" | "),
    }
}

fn accel_name(accel: Accel) -> &'static str {
    match accel {
        Accel::Kvm => "kvm",
        Accel::Tcg => "tcg",
        Accel::Auto => "auto",
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn show(ms: Option<f64>) -> String {
    ms.map_or_else(|| "never seen".into(), |ms| format!("{ms:.0} ms"))
}

fn range(samples: &[f64]) -> String {
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let max = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{min:.1}–{max:.1} ms")
}

fn verdict(overhead: f64, target: f64) -> &'static str {
    if overhead <= target {
        "met"
    } else {
        "NOT met"
    }
}
