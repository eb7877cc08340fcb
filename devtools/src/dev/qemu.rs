//! `vps dev --qemu N`: N real host agents in this process, each running its guests as QEMU
//! virtual machines (under TCG where KVM does not work), with the minimal guest image built
//! and registered, a `qemu` pool and a template whose warm pool is kept as paused guests. A
//! newcomer sees a real VM answer `vps sandboxes exec`.
//!
//! Guests get taps on a bridge in the machine's network namespace, so this needs root (or
//! CAP_NET_ADMIN) and an address range free on the machine: `10.43.0.0/24`.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use vps_commands::operator::{self as ops, RegisterImage};
use vps_domain::operator::PoolPolicy;
use vps_host::runtime::qemu::{Accel, Qemu};
use vps_host::{HostConfig, HostHandle, RuntimeKind};

const POOL: &str = "demo-qemu";
const CIDR: &str = "10.43.0.0/24";
const GATEWAY: &str = "10.43.0.1";
const BRIDGE: &str = "vpsbr0";
const IMAGE_ID: &str = "img_minimal";
const BUNDLE: &str = ".vps/guest/minimal.tar";
const BUILD_DIR: &str = ".vps/guest-build";
const NODES_FILE: &str = ".vps/dev-qemu-nodes.json";
/// The flavor guests get: small enough for TCG on a laptop.
const FLAVOR: &str = "micro";
pub const TEMPLATE: &str = "demo-minimal";

/// The real hosts, their pool and template; the agents stop when this is dropped (their
/// guests keep running, and the next `vps dev --qemu` re-adopts them).
pub struct QemuDemo {
    pub pool_id: String,
    pub template_id: String,
    pub hosts: Vec<HostHandle>,
}

/// Builds (once) and registers the minimal image, makes the pool and template, and starts `n`
/// host agents talking to `server_url`.
pub async fn start(
    ctx: &vps_commands::Ctx,
    server_url: &str,
    n: usize,
) -> anyhow::Result<QemuDemo> {
    let bundle = minimal_bundle().await?;
    register_image(ctx, &bundle).await?;
    let pool_id = pool(ctx).await?;
    let template_id = super::template(ctx, &pool_id, TEMPLATE, FLAVOR, IMAGE_ID, 1).await?;
    // KVM or TCG, decided once for every host of this machine (one probe boot at most), and
    // the CPU model the nodes are registered with: memory snapshots restore onto it.
    let image_dir = absolute(Path::new(".vps/images"))?;
    let probe = Qemu::new(
        absolute(Path::new(".vps/hosts/probe"))?,
        &image_dir,
        Accel::Auto,
    )?;
    let chosen = probe.chosen_accel().await;
    let nodes = super::nodes(
        ctx,
        &pool_id,
        n,
        NODES_FILE,
        "qemu",
        Some(vec!["qemu".into()]),
        &vps_host::runtime::qemu::cpu_model_of(chosen),
    )
    .await?;
    let mut hosts = Vec::new();
    for (node_id, token) in nodes {
        let state = PathBuf::from(".vps/hosts").join(&node_id);
        let config = HostConfig {
            server_url: server_url.to_string(),
            node_id,
            node_token: token,
            state_dir: absolute(&state.join("state"))?,
            image_dir: image_dir.clone(),
            bridge: Some(BRIDGE.into()),
            tunnel_listen: "127.0.0.1:0".into(),
            runtime: RuntimeKind::Qemu,
            accel: chosen.into(),
            metrics_listen: None,
            dns_upstream: None,
            image_cache_max_bytes: None,
            restore_slots: None,
            timings: Default::default(),
        };
        let runtime = Qemu::new(&config.state_dir, &config.image_dir, config.accel)?;
        hosts.push(vps_host::start(config, runtime).await?);
    }
    Ok(QemuDemo {
        pool_id,
        template_id,
        hosts,
    })
}

/// `.vps/guest/minimal.tar`, built from Debian's packages on first use (about 20 s).
async fn minimal_bundle() -> anyhow::Result<PathBuf> {
    let bundle = absolute(Path::new(BUNDLE))?;
    if !bundle.exists() {
        println!("building the minimal guest image (once) into {BUNDLE} …");
        let out = bundle.clone();
        tokio::task::spawn_blocking(move || {
            vps_guest_image::build_minimal(&out, Path::new(BUILD_DIR), |s| println!("  {s}"))
        })
        .await??;
    }
    Ok(bundle)
}

/// Registers the bundle by its `file://` path and digest (again on each start: a rebuilt
/// bundle gets its new digest).
async fn register_image(ctx: &vps_commands::Ctx, bundle: &Path) -> anyhow::Result<()> {
    let bytes = tokio::fs::read(bundle).await?;
    let image = RegisterImage {
        image_id: IMAGE_ID.into(),
        tenant_id: None,
        url: format!("file://{}", bundle.display()),
        sha256: data_encoding::HEXLOWER.encode(&Sha256::digest(&bytes)),
        format: "bundle".into(),
        verified: true,
    };
    ops::register_image(ctx, image).await?;
    Ok(())
}

/// The `qemu` pool, offered to `acme`, with one small flavor.
async fn pool(ctx: &vps_commands::Ctx) -> anyhow::Result<String> {
    let plan = super::PoolPlan {
        name: POOL,
        runtime: "qemu",
        cidr: CIDR,
        gateway: Some(GATEWAY),
        policy: PoolPolicy {
            recreate_on_host_loss: false,
            lost_after_seconds: Some(60),
        },
        quota: (16, 32, 200),
        flavors: &[(FLAVOR, 1, 1, 2)],
    };
    Ok(super::ensure_pool(ctx, plan).await?.0)
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    Ok(std::env::current_dir()?.join(path))
}
