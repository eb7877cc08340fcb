//! `vps bench <name>`: measure a capability and its baseline in the same run, on the
//! configured database server (in a scratch database, dropped afterwards). Human-readable
//! figures first, one JSON line last.

pub mod api;
pub mod converge;
pub mod delivery;
pub mod log;

use anyhow::Context;
use sqlx::{Connection, Executor, PgConnection, PgPool};

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
        let url = vps_pg::testing::with_database(server_url, &name);
        let pool = vps_events::connect(&url, &vps_events::DbOptions { max_connections }).await?;
        vps_events::migrate(&pool).await?;
        Ok(Scratch {
            pool,
            url,
            server_url: server_url.to_string(),
            name,
        })
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

/// A hosted pool with a /16 range, offered to [`TENANT`], with [`FLAVOR`], [`IMAGE`] and
/// `spec.nodes` nodes; returns the pool id and each node's id and token.
pub async fn setup_hosted_pool(
    ctx: &vps_commands::Ctx,
    spec: &BenchPool,
) -> anyhow::Result<(String, Vec<(String, String)>)> {
    use vps_commands::operator::{
        self as ops, CreateFlavor, CreatePool, OfferPool, RegisterImage, RegisterNode, SetIpPool,
    };
    let pool = ops::create_pool(
        ctx,
        CreatePool {
            name: "bench".into(),
            class: "vps-host".into(),
            runtime: None,
            provider_account_id: None,
            policy: Default::default(),
        },
    )
    .await?;
    let pool_id = pool["id"].as_str().unwrap_or_default().to_string();
    ops::set_ip_pool(
        ctx,
        SetIpPool {
            pool_id: pool_id.clone(),
            cidr: "10.0.0.0/16".into(),
            gateway: None,
        },
    )
    .await?;
    let quota = ["vcpu", "memoryGiB", "diskGiB"]
        .into_iter()
        .map(|k| (k.to_string(), spec.quota))
        .collect();
    ops::offer_pool(
        ctx,
        OfferPool {
            pool_id: pool_id.clone(),
            tenant_id: TENANT.into(),
            quota,
        },
    )
    .await?;
    ops::create_flavor(
        ctx,
        CreateFlavor {
            pool_id: pool_id.clone(),
            name: FLAVOR.into(),
            vcpu: 1,
            memory_gib: 1,
            disk_gib: 1,
            gpus: None,
            offer_id: None,
        },
    )
    .await?;
    ops::register_image(
        ctx,
        RegisterImage {
            image_id: IMAGE.into(),
            tenant_id: None,
            url: "https://images.example/bench.raw".into(),
            sha256: "0".repeat(64),
            format: "raw".into(),
            verified: true,
        },
    )
    .await?;
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
                pool_id: pool_id.clone(),
                name: format!("bench-{n}"),
                capacity,
                labels: Default::default(),
                runtimes: None,
                cpu_model: Some("emulated".into()),
            },
        )
        .await?;
        let field = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        nodes.push((
            field(&registered["node"]["id"]),
            field(&registered["nodeToken"]),
        ));
    }
    Ok((pool_id, nodes))
}
