//! `vps bench <name>`: measure a capability and its baseline in the same run, on the
//! configured database server (in a scratch database, dropped afterwards). Human-readable
//! figures first, one JSON line last.

pub mod api;
pub mod authz;
pub mod chaos;
pub mod converge;
pub mod delivery;
pub mod host;
pub mod list;
pub mod log;
pub mod replay;
pub mod report;
pub mod sandbox;
pub mod snapshot;
pub mod usage;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use sqlx::{Connection, Executor, PgConnection, PgPool};
use vps_events::{append, ExpectedVersion, Metadata, NewEvent, Notifier};

use vps_api::config::{Config, IdentityConfig};
use vps_api::server::RunningServer;

/// A scratch database for one benchmark run.
pub struct Scratch {
    /// Pool on the scratch database (migrated).
    pub pool: PgPool,
    /// Its URL.
    pub url: String,
    server_url: String,
    name: String,
}

impl Scratch {
    /// Creates and migrates `vps_bench_<ulid>` next to the configured database.
    pub async fn create(server_url: &str, max_connections: u32) -> anyhow::Result<Scratch> {
        let name = format!(
            "vps_bench_{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        );
        let mut admin = PgConnection::connect(server_url)
            .await
            .context("connect to the database server")?;
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await?;
        let url = vps_pg::connect::with_database(server_url, &name);
        let pool = vps_events::connect(&url, &vps_events::DbOptions { max_connections }).await?;
        vps_events::migrate(&pool).await?;
        Ok(Scratch {
            pool,
            url,
            server_url: server_url.to_string(),
            name,
        })
    }

    /// Runs `work` on a scratch database of its own next to this one, dropped after: for a
    /// baseline of appends measured before a server starts on this one, whose followers
    /// would otherwise read (publish, chain, project) every baseline event while the server
    /// is being measured.
    pub async fn beside<T>(
        &self,
        max_connections: u32,
        work: impl AsyncFnOnce(&Scratch) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let other = Scratch::create(&self.server_url, max_connections).await?;
        let done = work(&other).await;
        other.drop_database().await?;
        done
    }

    /// Closes the pool and drops the database.
    pub async fn drop_database(self) -> anyhow::Result<()> {
        self.pool.close().await;
        let mut admin = PgConnection::connect(&self.server_url).await?;
        admin
            .execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
            .await?;
        Ok(())
    }
}

/// Percentile of sorted samples (0.0..=1.0).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// Median of unsorted figures (the mean of the middle two of an even count).
pub fn median(figures: &[f64]) -> f64 {
    let mut sorted = figures.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// `x` rounded to `decimals` places, for the JSON line.
pub fn round(x: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

/// Tells when the log and every follower's position have stood still for a while: a bench
/// that builds its fleet first measures the capability, not the reactors still catching up
/// with the build. (Positions, not checkpoint times: an idle follower may still commit.)
#[derive(Default)]
pub struct Quiet {
    last: Option<Vec<(String, i64)>>,
    since: Option<Instant>,
}

impl Quiet {
    /// Whether nothing moved for `quiet`, looking now.
    pub async fn settled(&mut self, db: &PgPool, quiet: Duration) -> anyhow::Result<bool> {
        let now: Vec<(String, i64)> = sqlx::query_as(
            "SELECT '', coalesce(max(position), 0) FROM events
             UNION ALL SELECT name, position FROM follower_checkpoints ORDER BY 1",
        )
        .fetch_all(db)
        .await?;
        if self.last.as_ref() != Some(&now) {
            self.last = Some(now);
            self.since = Some(Instant::now());
        }
        Ok(self.since.is_some_and(|since| since.elapsed() >= quiet))
    }
}

/// A count over the time it took.
#[derive(Debug, Clone, Copy)]
pub struct Rate {
    /// What was counted (transactions, events).
    pub count: u64,
    /// Seconds it took.
    pub seconds: f64,
}

impl Rate {
    /// Count per second.
    pub fn per_second(&self) -> f64 {
        self.count as f64 / self.seconds
    }
}

/// When [`run_writers`] stops.
#[derive(Debug, Clone, Copy)]
pub enum Stop {
    /// Every writer stops starting operations after this long.
    After(Duration),
    /// The writers share this many operations between them.
    Total(u64),
}

/// Runs `writers` loops of `op(writer, iteration)` (iterations count from 0 per writer) until
/// `stop`; returns the summed counts `op` reports and the time it took.
pub async fn run_writers<F, Fut>(writers: usize, stop: Stop, op: F) -> anyhow::Result<Rate>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<u64>> + Send,
{
    let total = Arc::new(AtomicU64::new(0));
    let claimed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (op, total, claimed) = (op.clone(), total.clone(), claimed.clone());
        tasks.push(tokio::spawn(async move {
            for n in 0.. {
                let more = match stop {
                    Stop::After(duration) => started.elapsed() < duration,
                    Stop::Total(ops) => claimed.fetch_add(1, Ordering::Relaxed) < ops,
                };
                if !more {
                    break;
                }
                total.fetch_add(op(w, n).await?, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(Rate {
        count: total.load(Ordering::Relaxed),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// A small event like an instance's state change (`n` in its data).
pub fn new_event(n: u64) -> NewEvent {
    NewEvent {
        id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
        event_type: "bench.appended".into(),
        data: json!({ "n": n, "state": "running", "tenantId": TENANT }),
        metadata: Metadata {
            actor: Some("id_bench".into()),
            tenant_id: Some(TENANT.into()),
            ..Metadata::default()
        },
    }
}

/// The baseline of every benchmark: `writers` writers appending one event per transaction,
/// each to its own stream `<prefix>-<writer>`, for `duration`: what the log alone sustains.
pub async fn single_appends(
    pool: &PgPool,
    notifier: &Notifier,
    writers: usize,
    duration: Duration,
    prefix: &str,
) -> anyhow::Result<Rate> {
    let (pool, notifier, prefix) = (pool.clone(), notifier.clone(), prefix.to_string());
    run_writers(writers, Stop::After(duration), move |w, n| {
        let (pool, notifier, stream) = (pool.clone(), notifier.clone(), format!("{prefix}-{w}"));
        async move {
            let mut tx = pool.begin().await?;
            let expected = if n == 0 {
                ExpectedVersion::NoStream
            } else {
                ExpectedVersion::Exact(n as i64)
            };
            append(&mut tx, &stream, expected, &[new_event(n)]).await?;
            tx.commit().await?;
            notifier.committed();
            Ok(1)
        }
    })
    .await
}

/// A server configuration for a benchmark: loopback on a free port, a sealing key, an
/// operator and a [`TENANT`] identity with fresh random tokens; returns it with the tenant's
/// token.
pub fn server_config() -> (Config, String) {
    let token = |prefix: &str| {
        format!(
            "{prefix}_{}",
            data_encoding::HEXLOWER.encode(&rand::random::<[u8; 16]>())
        )
    };
    let tenant_token = token("tk");
    let mut config = Config::default();
    config.http.listen = "127.0.0.1:0".into();
    config.secrets.key = Some(data_encoding::BASE64.encode(&rand::random::<[u8; 32]>()));
    config.identities = vec![
        IdentityConfig {
            token: token("op"),
            identity: "id_bench_operator".into(),
            operator: true,
            tenant: None,
        },
        IdentityConfig {
            token: tenant_token.clone(),
            identity: "id_bench".into(),
            operator: false,
            tenant: Some(TENANT.into()),
        },
    ];
    (config, tenant_token)
}

/// A server on the scratch database with the hosted pool of `spec` set up.
pub struct HostedServer {
    /// The running server.
    pub server: RunningServer,
    /// The pool's id.
    pub pool_id: String,
    /// Each node's id and token.
    pub nodes: Vec<(String, String)>,
}

impl HostedServer {
    /// Starts the server and sets up the pool (see [`setup_hosted_pool`]).
    pub async fn start(pool: &PgPool, config: Config, spec: &BenchPool) -> anyhow::Result<Self> {
        let server = vps_api::server::start(config, pool.clone()).await?;
        let ctx = vps_api::server::reactor_ctx(&server.state, "bench");
        match setup_hosted_pool(&ctx, spec).await {
            Ok((pool_id, nodes)) => Ok(HostedServer {
                server,
                pool_id,
                nodes,
            }),
            Err(e) => {
                server.shutdown().await;
                Err(e)
            }
        }
    }

    /// An in-process emulated host for each node, configured by `adjust`.
    pub fn hosts(
        &self,
        adjust: impl Fn(&mut vps_emulators::host::HostConfig),
    ) -> Vec<vps_emulators::host::HostHandle> {
        self.nodes
            .iter()
            .map(|(node, token)| {
                let mut c = vps_emulators::host::HostConfig::new(self.server.url(), node, token);
                adjust(&mut c);
                vps_emulators::host::EmulatedHost::start(c)
            })
            .collect()
    }
}

/// `instances.create` over HTTP as the [`TENANT`], of one [`FLAVOR`] instance from [`IMAGE`].
#[derive(Clone)]
pub struct Creates {
    http: reqwest::Client,
    endpoint: String,
    token: String,
    pool_id: String,
}

impl Creates {
    /// Calls go to `server_url` with `token`, creating in `pool_id`.
    pub fn new(http: reqwest::Client, server_url: &str, token: &str, pool_id: &str) -> Self {
        Creates {
            http,
            endpoint: format!("{server_url}/api/compute/instances/create"),
            token: token.to_string(),
            pool_id: pool_id.to_string(),
        }
    }

    /// One call with `idempotency_key`; the answer as it came.
    pub async fn send(&self, idempotency_key: &str) -> reqwest::Result<reqwest::Response> {
        let body = json!({ "tenantId": TENANT, "poolId": self.pool_id, "flavor": FLAVOR,
                           "imageId": IMAGE, "idempotencyKey": idempotency_key });
        self.http
            .post(&self.endpoint)
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
    }
}

/// The benchmarks' tenant, flavor (1 vCPU, 1 GiB, 1 GiB disk) and public image.
pub const TENANT: &str = "bench";
/// See [`TENANT`].
pub const FLAVOR: &str = "bench";
/// See [`TENANT`].
pub const IMAGE: &str = "img_bench";

/// The hosted pool a benchmark runs in.
#[derive(Debug, Clone)]
pub struct BenchPool {
    /// Nodes to register.
    pub nodes: usize,
    /// vCPUs (and GiB of memory and disk) of each node.
    pub node_size: u32,
    /// The tenant's quota of each resource.
    pub quota: u64,
}

/// A bench pool's name, runtime and range, and [`TENANT`]'s quota of each resource.
pub struct BenchRange {
    pub name: &'static str,
    pub runtime: Option<&'static str>,
    pub cidr: &'static str,
    pub gateway: Option<&'static str>,
    pub quota: u64,
}

/// A hosted pool with `range`, offered to [`TENANT`], with [`FLAVOR`] (1 vCPU, 1 GiB, 1 GiB
/// disk); returns its id.
pub async fn pool_with_flavor(
    ctx: &vps_commands::Ctx,
    range: &BenchRange,
) -> anyhow::Result<String> {
    use vps_commands::operator::{self as ops, CreateFlavor, CreatePool, OfferPool, SetIpPool};
    let pool = ops::create_pool(
        ctx,
        CreatePool {
            name: range.name.into(),
            class: "vps-host".into(),
            runtime: range.runtime.map(Into::into),
            provider_account_id: None,
            policy: Default::default(),
        },
    )
    .await?;
    let pool_id = pool.id;
    ops::set_ip_pool(
        ctx,
        SetIpPool {
            pool_id: pool_id.parse()?,
            cidr: range.cidr.into(),
            gateway: range.gateway.map(Into::into),
        },
    )
    .await?;
    let quota = ["vcpu", "memoryGiB", "diskGiB"]
        .into_iter()
        .map(|k| (k.to_string(), range.quota))
        .collect();
    ops::offer_pool(
        ctx,
        OfferPool {
            pool_id: pool_id.parse()?,
            tenant_id: TENANT.into(),
            quota,
        },
    )
    .await?;
    ops::create_flavor(
        ctx,
        CreateFlavor {
            pool_id: pool_id.parse()?,
            name: FLAVOR.into(),
            vcpu: 1,
            memory_gib: 1,
            disk_gib: 1,
            gpus: None,
            offer_id: None,
        },
    )
    .await?;
    Ok(pool_id)
}

/// A hosted pool with a /16 range, offered to [`TENANT`], with [`FLAVOR`], [`IMAGE`] and
/// `spec.nodes` nodes; returns the pool id and each node's id and token.
pub async fn setup_hosted_pool(
    ctx: &vps_commands::Ctx,
    spec: &BenchPool,
) -> anyhow::Result<(String, Vec<(String, String)>)> {
    use vps_commands::operator::{self as ops, RegisterNode};
    let range = BenchRange {
        name: "bench",
        runtime: None,
        cidr: "10.0.0.0/16",
        gateway: None,
        quota: spec.quota,
    };
    let pool_id = pool_with_flavor(ctx, &range).await?;
    register_bench_image(ctx).await?;
    let mut nodes = Vec::with_capacity(spec.nodes);
    for n in 0..spec.nodes {
        let size = spec.node_size;
        let capacity = vps_domain::resources::Capacity {
            vcpu: size,
            memory_gib: size,
            disk_gib: size,
            gpus: vec![],
        };
        let registered = ops::register_node(
            ctx,
            RegisterNode {
                pool_id: pool_id.parse()?,
                name: format!("bench-{n}"),
                capacity,
                labels: Default::default(),
                runtimes: None,
                cpu_model: Some("emulated".into()),
            },
        )
        .await?;
        nodes.push((registered.node.id, registered.node_token));
    }
    Ok((pool_id, nodes))
}

/// The bench image [`IMAGE`], public, registered as every emulated-host bench uses it (the
/// emulated hosts never fetch it).
pub(crate) async fn register_bench_image(ctx: &vps_commands::Ctx) -> anyhow::Result<()> {
    vps_commands::operator::register_image(
        ctx,
        vps_commands::operator::RegisterImage {
            image_id: IMAGE.into(),
            tenant_id: None,
            url: "https://images.example/bench.raw".into(),
            sha256: "0".repeat(64),
            format: "raw".into(),
            verified: true,
        },
    )
    .await?;
    Ok(())
}
