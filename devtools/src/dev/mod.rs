//! `vps dev --sim N`: the server on the embedded database with N emulated hosts and a demo
//! pool, so a newcomer can create an instance and watch it run within seconds; `--qemu N`
//! adds N real hosts that run guests as QEMU virtual machines ([`qemu`]).

mod qemu;

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use vps_commands::operator::{
    self as ops, CreateFlavor, CreatePool, OfferPool, RegisterImage, RegisterNode, SetIpPool,
};
use vps_domain::operator::PoolPolicy;
use vps_domain::resources::Capacity;
use vps_emulators::host::{EmulatedHost, HostConfig, HostHandle};

use vps_api::config::{Config, IdentityConfig};
use vps_api::database::Database;

const DEMO_POOL: &str = "demo";
const NODES_FILE: &str = ".vps/dev-nodes.json";
/// The sealing key `vps dev` generates on first run and keeps, so sealed data survives a restart.
const KEY_FILE: &str = ".vps/secrets.key";
/// The sandbox CA `vps dev` generates on first run and keeps (`[sandbox_exec] ca_key`).
const CA_FILE: &str = ".vps/sandbox-ca";

/// Runs the dev server until interrupted.
pub async fn run(mut config: Config, hosts: usize, real_hosts: usize) -> anyhow::Result<i32> {
    if config.identities.is_empty() {
        config.identities = vec![
            identity("op", "id_operator", None),
            identity("tk", "id_alice", Some("acme")),
        ];
    }
    if config.secrets.key.is_none() {
        config.secrets.key = Some(dev_secrets_key()?);
    }
    if config.sandbox_exec.ca_key.is_none() {
        vps_commands::sandboxes::exec::ca::SandboxCa::load_or_generate(Path::new(CA_FILE))
            .map_err(anyhow::Error::msg)?;
        config.sandbox_exec.ca_key = Some(CA_FILE.into());
    }
    if config.webhooks.allow_private.is_empty() {
        // A demo's receivers run on the same machine.
        config.webhooks.allow_private = vec!["127.0.0.0/8".into()];
    }
    if config.timings == vps_api::config::Timings::default() {
        // Snappier than production so the demo converges in seconds.
        config.timings.transitional_look = 2.0;
        config.timings.unschedulable_retry = 5.0;
        config.timings.sandbox_pass = 2.0;
    }
    let db = Database::open(&config, vps_api::database::SERVE_CONNECTIONS).await?;
    let server = vps_api::server::start(config.clone(), db.pool.clone()).await?;
    let ctx = vps_api::server::reactor_ctx(&server.state, "dev");
    let pool_id = demo_pool(&ctx).await?;
    let template_id = template(&ctx, &pool_id, "demo-py", "small", "img_demo", 2).await?;
    let nodes = nodes(&ctx, &pool_id, hosts, NODES_FILE, "sim", None, "emulated").await?;
    let _hosts: Vec<HostHandle> = nodes
        .iter()
        .map(|(node, token)| {
            let mut host = HostConfig::new(server.url(), node.clone(), token.clone());
            host.boot_delay = Duration::from_secs(2);
            host.tunnel_listen = Some("127.0.0.1:0".into());
            EmulatedHost::start(host)
        })
        .collect();
    let real = match real_hosts {
        0 => None,
        n => Some(qemu::start(&ctx, &server.url(), n).await?),
    };

    print_guide(
        &config,
        &server.url(),
        &db.url,
        nodes.len(),
        &pool_id,
        &template_id,
    );
    if let Some(real) = &real {
        print_qemu_guide(&server.url(), real);
    }
    println!("press Ctrl-C to stop");
    vps_api::server::shutdown_signal().await;
    server.shutdown().await;
    db.pool.close().await;
    Ok(0)
}

/// What `vps dev` prints: where it runs, the tokens, and commands to try.
fn print_guide(
    config: &Config,
    url: &str,
    db_url: &str,
    hosts: usize,
    pool_id: &str,
    template_id: &str,
) {
    let tenant_token = &config
        .identities
        .iter()
        .find(|i| !i.operator)
        .map(|i| i.token.clone())
        .unwrap_or_default();
    println!("vps dev is running at {url} with {} emulated hosts", hosts);
    println!("database: {}", vps_api::database::redact(db_url));
    for id in &config.identities {
        let who = if id.operator {
            "operator".to_string()
        } else {
            format!("tenant {}", id.tenant.as_deref().unwrap_or(""))
        };
        println!("token for {} ({who}): {}", id.identity, id.token);
    }
    println!("\ncreate an instance (answers once it runs, or after 15 s):");
    println!(
        "  curl -s -X POST {url}/api/compute/instances/create -H 'Authorization: Bearer {tenant_token}' \\\n    -d '{{\"tenantId\":\"acme\",\"poolId\":\"{pool_id}\",\"flavor\":\"small\",\"imageId\":\"img_demo\",\"idempotencyKey\":\"demo-1\",\"wait\":{{\"timeoutMs\":15000}}}}'"
    );
    println!("\ncreate a sandbox from the demo template (warm pool of 2; ready in milliseconds once warm):");
    println!(
        "  curl -s -X POST {url}/api/compute/sandboxes/create -H 'Authorization: Bearer {tenant_token}' \\\n    -d '{{\"tenantId\":\"acme\",\"templateId\":\"{template_id}\",\"ttlSeconds\":900,\"idempotencyKey\":\"sbx-1\",\"wait\":{{\"timeoutMs\":15000}}}}'"
    );
    // This binary's own path: `cargo run` would start a build of minutes.
    let me = std::env::current_exe().unwrap_or_else(|_| "vps".into());
    let me = me.display();
    println!("\nor with the CLI ({me} <group> --help lists the methods):");
    println!("  export VPS_URL={url} VPS_TOKEN={tenant_token} VPS_TENANT=acme");
    println!("  {me} instances create --pool {pool_id} --flavor small --image img_demo --wait");
    println!("  {me} sandboxes create --template {template_id} --ttl 15m --wait");
    println!("  {me} sandboxes exec <sbx_…> -- echo hi");
    println!("watch the log:   {me} events tail");
    println!("the console:     {url}/console (sign in with the tenant token, tenant acme)");
    println!("delete it:       curl -s -X POST {url}/api/compute/instances/delete -H 'Authorization: Bearer {tenant_token}' -d '{{\"tenantId\":\"acme\",\"instanceId\":\"<id>\"}}'");
}

/// What `vps dev --qemu` adds to the guide.
fn print_qemu_guide(url: &str, real: &qemu::QemuDemo) {
    println!(
        "\n{} real host(s) run guests as QEMU virtual machines (pool {}, template {}):",
        real.hosts.len(),
        real.pool_id,
        qemu::TEMPLATE
    );
    let me = std::env::current_exe().unwrap_or_else(|_| "vps".into());
    println!("  export VPS_URL={url}");
    println!(
        "  {} sandboxes create --template {} --ttl 15m --wait",
        me.display(),
        real.template_id
    );
    println!("  {} sandboxes exec <sbx_…> -- uname -r", me.display());
}

/// The key in `.vps/secrets.key`, generated (32 random bytes, base64, readable by the owner
/// only) when the file does not exist yet. Only `vps dev` does this: `vps serve` refuses to
/// start without a configured key.
fn dev_secrets_key() -> anyhow::Result<String> {
    if let Ok(text) = std::fs::read_to_string(KEY_FILE) {
        return Ok(text.trim().to_string());
    }
    let key = data_encoding::BASE64.encode(&rand::random::<[u8; 32]>());
    if let Some(dir) = Path::new(KEY_FILE).parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    std::io::Write::write_all(&mut options.open(KEY_FILE)?, key.as_bytes())?;
    Ok(key)
}

fn identity(prefix: &str, identity: &str, tenant: Option<&str>) -> IdentityConfig {
    use rand::Rng;
    let bytes: [u8; 16] = rand::thread_rng().gen();
    IdentityConfig {
        token: format!("{prefix}_{}", data_encoding::HEXLOWER.encode(&bytes)),
        identity: identity.into(),
        operator: tenant.is_none(),
        tenant: tenant.map(str::to_string),
    }
}

/// A demo pool: hosted, with an IP range, offered to `acme`, with its flavors.
struct PoolPlan {
    name: &'static str,
    runtime: &'static str,
    cidr: &'static str,
    gateway: Option<&'static str>,
    policy: PoolPolicy,
    /// `acme`'s quota: vCPUs, memory GiB, disk GiB.
    quota: (u64, u64, u64),
    /// Name, vCPUs, memory GiB, disk GiB.
    flavors: &'static [(&'static str, u32, u32, u32)],
}

/// The pool `plan` names, created on first run (answers its id, and whether it is new).
async fn ensure_pool(ctx: &vps_commands::Ctx, plan: PoolPlan) -> anyhow::Result<(String, bool)> {
    let existing = vps_projections::pools::id_by_name(&ctx.pool, plan.name).await?;
    if let Some(id) = existing {
        return Ok((id, false));
    }
    let pool = ops::create_pool(
        ctx,
        CreatePool {
            name: plan.name.into(),
            class: "vps-host".into(),
            runtime: Some(plan.runtime.into()),
            provider_account_id: None,
            policy: plan.policy,
        },
    )
    .await?;
    let id = pool.id;
    let range = SetIpPool {
        pool_id: id.parse()?,
        cidr: plan.cidr.into(),
        gateway: plan.gateway.map(Into::into),
    };
    ops::set_ip_pool(ctx, range).await?;
    let (vcpu, memory, disk) = plan.quota;
    let quota = [
        ("vcpu", vcpu),
        ("memoryGiB", memory),
        ("diskGiB", disk),
        ("gpu", 0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let offer = OfferPool {
        pool_id: id.parse()?,
        tenant_id: "acme".into(),
        quota,
    };
    ops::offer_pool(ctx, offer).await?;
    for &(name, vcpu, memory_gib, disk_gib) in plan.flavors {
        let flavor = CreateFlavor {
            pool_id: id.parse()?,
            name: name.into(),
            vcpu,
            memory_gib,
            disk_gib,
            gpus: None,
            offer_id: None,
        };
        ops::create_flavor(ctx, flavor).await?;
    }
    Ok((id, true))
}

/// The demo pool (`demo`, emulated hosts): two flavors and a public image.
async fn demo_pool(ctx: &vps_commands::Ctx) -> anyhow::Result<String> {
    let plan = PoolPlan {
        name: DEMO_POOL,
        runtime: "libvirt-kvm",
        cidr: "10.42.0.0/24",
        gateway: None,
        policy: PoolPolicy {
            recreate_on_host_loss: true,
            lost_after_seconds: Some(30),
        },
        quota: (64, 256, 2000),
        flavors: &[("small", 1, 2, 20), ("medium", 4, 8, 20)],
    };
    let (id, created) = ensure_pool(ctx, plan).await?;
    if created {
        let image = RegisterImage {
            image_id: "img_demo".into(),
            tenant_id: None,
            url: "https://cloud-images.example/demo.qcow2".into(),
            sha256: "0".repeat(64),
            format: "qcow2".into(),
            verified: true,
        };
        ops::register_image(ctx, image).await?;
    }
    Ok(id)
}

/// The demo sandbox template `name` of tenant `acme` (kept across restarts), owned by the
/// tenant's identity so its warm instances are the tenant's.
async fn template(
    ctx: &vps_commands::Ctx,
    pool_id: &str,
    name: &str,
    flavor: &str,
    image_id: &str,
    warm: u32,
) -> anyhow::Result<String> {
    let existing = vps_projections::sandboxes::live_template_named(&ctx.pool, "acme", name).await?;
    if let Some(id) = existing {
        return Ok(id);
    }
    let mut tenant = ctx.clone();
    tenant.actor.identity = "id_alice".into();
    tenant.actor.tenant = Some("acme".into());
    let input = vps_commands::sandboxes::templates::TemplateInput {
        tenant_id: "acme".into(),
        name: name.into(),
        pool_id: pool_id.parse()?,
        flavor: flavor.into(),
        image_id: image_id.into(),
        labels: None,
        settings: vps_commands::sandboxes::templates::TemplateSettings {
            default_ttl_seconds: Some(900),
            max_ttl_seconds: Some(3600),
            warm: Some(vps_domain::template::Warm {
                min: warm,
                max: warm,
            }),
            ..Default::default()
        },
    };
    let template = vps_commands::sandboxes::templates::create(&tenant, input).await?;
    Ok(template.id)
}

/// `hosts` nodes of `pool_id` with their tokens: reused from `file` when still registered,
/// registered anew otherwise (a token is shown only once).
async fn nodes(
    ctx: &vps_commands::Ctx,
    pool_id: &str,
    hosts: usize,
    file: &str,
    prefix: &str,
    runtimes: Option<Vec<String>>,
    cpu_model: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let saved: Vec<(String, String)> = std::fs::read_to_string(file)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let mut nodes = Vec::new();
    for (node, token) in saved {
        let known: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM node_tokens WHERE node_id = $1 AND token_hash = $2)",
        )
        .bind(&node)
        .bind(ops::token_hash(&token))
        .fetch_one(&ctx.pool)
        .await?;
        if known && nodes.len() < hosts {
            nodes.push((node, token));
        }
    }
    while nodes.len() < hosts {
        let name = format!(
            "{prefix}-{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        );
        let registered = ops::register_node(
            ctx,
            RegisterNode {
                pool_id: pool_id.parse()?,
                name,
                capacity: Capacity {
                    vcpu: 32,
                    memory_gib: 128,
                    disk_gib: 1000,
                    gpus: vec![],
                },
                labels: Default::default(),
                cpu_model: Some(cpu_model.into()),
                runtimes: runtimes.clone(),
            },
        )
        .await?;
        nodes.push((registered.node.id, registered.node_token));
    }
    if let Some(dir) = Path::new(file).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(file, serde_json::to_string(&json!(nodes))?)?;
    Ok(nodes)
}
