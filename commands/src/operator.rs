//! The operator's resources: pools, offers, IP ranges, nodes, flavors and images. Each change
//! is one event on the resource's stream.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::Row;
use vps_domain::ipam::Ipv4Cidr;
use vps_domain::operator::*;
use vps_domain::resources::{Capacity, Gpus, QuotaResource, Shape};
use vps_domain::DomainError;
use vps_events::ExpectedVersion;
use vps_projections::views;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::record::{new_id, record_one};

const RUNTIMES: &[&str] = &[
    "libvirt-kvm",
    "cloud-hypervisor",
    "firecracker",
    "containerd",
];

/// `pools.create`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreatePool {
    /// Unique name.
    pub name: String,
    /// `vps-host` or `provider`.
    pub class: String,
    /// Hosted pools' runtime (default `libvirt-kvm`).
    pub runtime: Option<String>,
    /// Provider pools' account.
    pub provider_account_id: Option<String>,
    /// Host-loss policy.
    #[serde(default)]
    pub policy: PoolPolicy,
}

fn invalid(field: &str, message: impl Into<String>) -> CommandError {
    CommandError::Domain(DomainError::InvalidInput {
        field: field.into(),
        message: message.into(),
    })
}

fn not_found(what: String) -> CommandError {
    CommandError::Domain(DomainError::NotFound { what })
}

fn check_name(field: &str, name: &str) -> Result<(), CommandError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(invalid(field, "1 to 63 letters, digits, '-', '_' or '.'"))
    }
}

/// Refuses a `name` already used in `table` (within `pool_id` when given) as INVALID_INPUT.
pub(crate) async fn ensure_name_free(
    tx: &mut sqlx::PgConnection,
    table: &'static str,
    pool_id: Option<&str>,
    name: &str,
    what: &str,
) -> Result<(), CommandError> {
    let scope = if pool_id.is_some() {
        " AND pool_id = $2"
    } else {
        ""
    };
    let sql = format!("SELECT EXISTS (SELECT 1 FROM {table} WHERE name = $1{scope})");
    let mut query = sqlx::query_scalar(&sql).bind(name);
    if let Some(pool_id) = pool_id {
        query = query.bind(pool_id);
    }
    let taken: bool = query.fetch_one(&mut *tx).await?;
    if !taken {
        return Ok(());
    }
    let place = if pool_id.is_some() {
        " in this pool"
    } else {
        ""
    };
    Err(invalid(
        "name",
        format!("a {what} named {name} exists{place}"),
    ))
}

/// Creates a pool.
pub async fn create_pool(ctx: &Ctx, input: CreatePool) -> Result<Value, CommandError> {
    check_name("name", &input.name)?;
    let runtime = match input.class.as_str() {
        "vps-host" => {
            let runtime = input
                .runtime
                .clone()
                .unwrap_or_else(|| "libvirt-kvm".into());
            if !RUNTIMES.contains(&runtime.as_str()) {
                return Err(invalid(
                    "runtime",
                    format!("one of {}", RUNTIMES.join(", ")),
                ));
            }
            Some(runtime)
        }
        "provider" => {
            if input.runtime.is_some() {
                return Err(invalid("runtime", "provider pools have no runtime"));
            }
            None
        }
        _ => return Err(invalid("class", "`vps-host` or `provider`")),
    };
    if input.policy.lost_after_seconds == Some(0) {
        return Err(invalid("policy.lostAfterSeconds", "must be positive"));
    }
    let mut tx = ctx.pool.begin().await?;
    ensure_name_free(&mut tx, "pools", None, &input.name, "pool").await?;
    let id = new_id("pool");
    let event = PoolCreated {
        pool_id: id.clone(),
        name: input.name,
        class: input.class,
        runtime,
        provider_account_id: input.provider_account_id,
        policy: input.policy,
    };
    record_one(
        &mut tx,
        &format!("pool-{id}"),
        ExpectedVersion::NoStream,
        "pool.created",
        &event,
        &ctx.metadata(None),
    )
    .await?;
    let view = views::pool(&mut *tx, &id).await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(view.expect("just created"))
}

/// `pools.update`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdatePool {
    /// The pool.
    pub pool_id: String,
    /// A new name.
    pub name: Option<String>,
    /// A new policy.
    pub policy: Option<PoolPolicy>,
}

async fn pool_version(
    tx: &mut sqlx::PgConnection,
    pool_id: &str,
) -> Result<(i64, Value), CommandError> {
    let view = views::pool(&mut *tx, pool_id)
        .await?
        .ok_or_else(|| not_found(format!("pool {pool_id}")))?;
    Ok((view["version"].as_i64().unwrap_or(0), view))
}

/// Renames a pool or changes its policy.
pub async fn update_pool(ctx: &Ctx, input: UpdatePool) -> Result<Value, CommandError> {
    if let Some(name) = &input.name {
        check_name("name", name)?;
    }
    let mut tx = ctx.pool.begin().await?;
    let (version, view) = pool_version(&mut tx, &input.pool_id).await?;
    let event = PoolUpdated {
        pool_id: input.pool_id.clone(),
        name: input
            .name
            .unwrap_or_else(|| view["name"].as_str().unwrap_or_default().to_string()),
        policy: match input.policy {
            Some(p) => p,
            None => serde_json::from_value(view["policy"].clone()).unwrap_or_default(),
        },
    };
    finish_pool_change(ctx, tx, &input.pool_id, version, "pool.updated", &event).await
}

/// Records a pool's event, commits and answers the pool as it is now.
async fn finish_pool_change(
    ctx: &Ctx,
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    pool_id: &str,
    version: i64,
    event_type: &str,
    event: &impl serde::Serialize,
) -> Result<Value, CommandError> {
    let stream = format!("pool-{pool_id}");
    record_one(
        &mut tx,
        &stream,
        ExpectedVersion::Exact(version),
        event_type,
        event,
        &ctx.metadata(None),
    )
    .await?;
    let view = views::pool(&mut *tx, pool_id).await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(view.expect("the pool exists"))
}

/// `pools.offer`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OfferPool {
    /// The pool.
    pub pool_id: String,
    /// The tenant it becomes visible to.
    pub tenant_id: String,
    /// Maxima per resource; a missing one is 0.
    #[serde(default)]
    pub quota: BTreeMap<String, u64>,
}

/// Offers a pool to a tenant with quota maxima.
pub async fn offer_pool(ctx: &Ctx, input: OfferPool) -> Result<Value, CommandError> {
    check_name("tenantId", &input.tenant_id)?;
    for (resource, max) in &input.quota {
        if QuotaResource::parse(resource).is_none() {
            return Err(invalid(
                &format!("quota.{resource}"),
                "unknown resource (vcpu, memoryGiB, diskGiB, gpu)",
            ));
        }
        if *max > 1_000_000_000 {
            return Err(invalid(&format!("quota.{resource}"), "out of range"));
        }
    }
    let mut tx = ctx.pool.begin().await?;
    let (version, _) = pool_version(&mut tx, &input.pool_id).await?;
    let event = PoolOffered {
        pool_id: input.pool_id.clone(),
        tenant_id: input.tenant_id.clone(),
        quota: input.quota.clone(),
    };
    record_one(
        &mut tx,
        &format!("pool-{}", input.pool_id),
        ExpectedVersion::Exact(version),
        "pool.offered",
        &event,
        &ctx.metadata(Some(&input.tenant_id)),
    )
    .await?;
    tx.commit().await?;
    ctx.notifier.committed();
    let quota: BTreeMap<&str, u64> = QuotaResource::ALL
        .into_iter()
        .map(|r| {
            (
                r.as_str(),
                input.quota.get(r.as_str()).copied().unwrap_or(0),
            )
        })
        .collect();
    Ok(serde_json::json!({ "poolId": input.pool_id, "tenantId": input.tenant_id, "quota": quota }))
}

/// `pools.setIpPool`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetIpPool {
    /// The pool.
    pub pool_id: String,
    /// IPv4 CIDR.
    pub cidr: String,
    /// Default: the first host address.
    pub gateway: Option<String>,
}

/// Sets a hosted pool's IPv4 range.
pub async fn set_ip_pool(ctx: &Ctx, input: SetIpPool) -> Result<Value, CommandError> {
    let cidr = Ipv4Cidr::parse(&input.cidr).map_err(|e| invalid("cidr", e.to_string()))?;
    let gateway = match &input.gateway {
        Some(g) => {
            let addr = g
                .parse()
                .map_err(|_| invalid("gateway", "not an IPv4 address"))?;
            cidr.check_gateway(addr)
                .map_err(|e| invalid("gateway", e.to_string()))?;
            addr
        }
        None => cidr.default_gateway(),
    };
    let mut tx = ctx.pool.begin().await?;
    let (version, view) = pool_version(&mut tx, &input.pool_id).await?;
    if view["class"] != "vps-host" {
        return Err(invalid("poolId", "only hosted pools have an IP range"));
    }
    let leased: i64 = sqlx::query_scalar("SELECT count(*) FROM ip_leases WHERE pool_id = $1")
        .bind(&input.pool_id)
        .fetch_one(&mut *tx)
        .await?;
    if leased > 0 && view["ipPool"]["cidr"].as_str() != Some(input.cidr.as_str()) {
        return Err(CommandError::Domain(DomainError::InvalidState {
            message: format!("{leased} addresses are leased from the current range"),
        }));
    }
    let event = IpRangeSet {
        pool_id: input.pool_id.clone(),
        cidr: input.cidr.clone(),
        gateway: gateway.to_string(),
    };
    finish_pool_change(
        ctx,
        tx,
        &input.pool_id,
        version,
        "pool.ip_range.set",
        &event,
    )
    .await
}

/// `nodes.register`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterNode {
    /// A hosted pool.
    pub pool_id: String,
    /// Unique in the pool.
    pub name: String,
    /// What it offers.
    pub capacity: Capacity,
    /// Placement labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Runtimes it advertises (default: the pool's).
    pub runtimes: Option<Vec<String>>,
    /// CPU model.
    pub cpu_model: Option<String>,
}

/// Registers a node; returns the node and its token (shown once).
pub async fn register_node(ctx: &Ctx, input: RegisterNode) -> Result<Value, CommandError> {
    check_name("name", &input.name)?;
    let c = &input.capacity;
    if c.vcpu == 0
        || c.memory_gib == 0
        || c.vcpu > 4096
        || c.memory_gib > 65_536
        || c.disk_gib > 1_048_576
    {
        return Err(invalid(
            "capacity",
            "vcpu and memoryGiB must be positive and in range",
        ));
    }
    let mut tx = ctx.pool.begin().await?;
    let view = views::pool(&mut *tx, &input.pool_id)
        .await?
        .ok_or_else(|| not_found(format!("pool {}", input.pool_id)))?;
    if view["class"] != "vps-host" {
        return Err(invalid("poolId", "nodes belong to hosted (vps-host) pools"));
    }
    ensure_name_free(&mut tx, "nodes", Some(&input.pool_id), &input.name, "node").await?;
    let runtimes = input.runtimes.unwrap_or_else(|| {
        vec![view["runtime"]
            .as_str()
            .unwrap_or("libvirt-kvm")
            .to_string()]
    });
    if let Some(bad) = runtimes.iter().find(|r| !RUNTIMES.contains(&r.as_str())) {
        return Err(invalid("runtimes", format!("unknown runtime {bad}")));
    }
    let id = new_id("node");
    let token = format!("nt_{}", hex::encode(rand::random::<[u8; 24]>()));
    let event = NodeRegistered {
        node_id: id.clone(),
        pool_id: input.pool_id,
        name: input.name,
        capacity: input.capacity,
        labels: input.labels,
        runtimes,
        cpu_model: input.cpu_model,
        token_hash: token_hash(&token),
    };
    record_one(
        &mut tx,
        &format!("node-{id}"),
        ExpectedVersion::NoStream,
        "node.registered",
        &event,
        &ctx.metadata(None),
    )
    .await?;
    let node = views::node(&mut *tx, &id).await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(serde_json::json!({ "node": node, "nodeToken": token }))
}

/// The stored form of a node token.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Cordons (`true`) or uncordons a node.
pub async fn set_cordon(ctx: &Ctx, node_id: &str, cordon: bool) -> Result<Value, CommandError> {
    let mut tx = ctx.pool.begin().await?;
    let row = sqlx::query("SELECT version, state FROM nodes WHERE id = $1")
        .bind(node_id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| not_found(format!("node {node_id}")))?;
    let (version, state): (i64, String) = (row.get(0), row.get(1));
    if (state == "cordoned") != cordon {
        let event_type = if cordon {
            "node.cordoned"
        } else {
            "node.uncordoned"
        };
        record_one(
            &mut tx,
            &format!("node-{node_id}"),
            ExpectedVersion::Exact(version),
            event_type,
            &NodeStateChanged {
                node_id: node_id.into(),
            },
            &ctx.metadata(None),
        )
        .await?;
    }
    let node = views::node(&mut *tx, node_id).await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(node.expect("exists"))
}

/// `flavors.create`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateFlavor {
    /// The pool.
    pub pool_id: String,
    /// Unique in the pool.
    pub name: String,
    /// vCPUs.
    pub vcpu: u32,
    /// Memory.
    #[serde(rename = "memoryGiB")]
    pub memory_gib: u32,
    /// Disk.
    #[serde(rename = "diskGiB")]
    pub disk_gib: u32,
    /// Whole GPUs of one model.
    pub gpus: Option<Gpus>,
    /// Provider pools: the provider's offer.
    pub offer_id: Option<String>,
}

/// Creates a flavor.
pub async fn create_flavor(ctx: &Ctx, input: CreateFlavor) -> Result<Value, CommandError> {
    check_name("name", &input.name)?;
    if input.vcpu == 0 || input.vcpu > 1024 {
        return Err(invalid("vcpu", "1 to 1024"));
    }
    if input.memory_gib == 0 || input.memory_gib > 16_384 {
        return Err(invalid("memoryGiB", "1 to 16384"));
    }
    if input.disk_gib > 1_048_576 {
        return Err(invalid("diskGiB", "at most 1048576"));
    }
    if let Some(g) = &input.gpus {
        if g.count == 0 || g.model.is_empty() {
            return Err(invalid("gpus", "a model and a positive count"));
        }
    }
    let mut tx = ctx.pool.begin().await?;
    let pool = views::pool(&mut *tx, &input.pool_id)
        .await?
        .ok_or_else(|| not_found(format!("pool {}", input.pool_id)))?;
    if pool["class"] == "provider" && input.offer_id.is_none() {
        return Err(invalid(
            "offerId",
            "provider pools' flavors name the provider's offer",
        ));
    }
    ensure_name_free(
        &mut tx,
        "flavors",
        Some(&input.pool_id),
        &input.name,
        "flavor",
    )
    .await?;
    let id = new_id("flv");
    let event = FlavorCreated {
        flavor_id: id.clone(),
        pool_id: input.pool_id,
        name: input.name,
        shape: Shape {
            vcpu: input.vcpu,
            memory_gib: input.memory_gib,
            disk_gib: input.disk_gib,
            gpus: input.gpus,
        },
        offer_id: input.offer_id,
    };
    record_one(
        &mut tx,
        &format!("flavor-{id}"),
        ExpectedVersion::NoStream,
        "flavor.created",
        &event,
        &ctx.metadata(None),
    )
    .await?;
    let view = views::flavor(&mut *tx, &id).await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(view.expect("just created"))
}

/// Archives a flavor: no new instances of it.
pub async fn archive_flavor(ctx: &Ctx, flavor_id: &str) -> Result<Value, CommandError> {
    let mut tx = ctx.pool.begin().await?;
    let event = FlavorArchived {
        flavor_id: flavor_id.into(),
    };
    let target = Flagged {
        table: "flavors",
        flag: "archived",
        kind: "flavor",
        id: flavor_id,
    };
    record_unless_flagged(ctx, &mut tx, &target, "flavor.archived", &event).await?;
    let view = views::flavor(&mut *tx, flavor_id).await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(view.expect("exists"))
}

/// A resource whose change sets a boolean column of its projection (archived, deleted).
struct Flagged<'a> {
    table: &'static str,
    flag: &'static str,
    kind: &'static str,
    id: &'a str,
}

/// Records `event` on the resource's stream unless its flag is already set (the change is
/// idempotent); `NOT_FOUND` when it does not exist.
async fn record_unless_flagged(
    ctx: &Ctx,
    tx: &mut sqlx::PgConnection,
    target: &Flagged<'_>,
    event_type: &str,
    event: &impl serde::Serialize,
) -> Result<(), CommandError> {
    let Flagged {
        table,
        flag,
        kind,
        id,
    } = target;
    let row = sqlx::query(&format!(
        "SELECT version, {flag} FROM {table} WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| not_found(format!("{kind} {id}")))?;
    let (version, set): (i64, bool) = (row.get(0), row.get(1));
    if !set {
        let stream = format!("{kind}-{id}");
        record_one(
            tx,
            &stream,
            ExpectedVersion::Exact(version),
            event_type,
            event,
            &ctx.metadata(None),
        )
        .await?;
    }
    Ok(())
}

/// `images.register`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterImage {
    /// The id (`img_…` or any name of letters, digits, `-_.`).
    pub image_id: String,
    /// Owner; absent = public.
    pub tenant_id: Option<String>,
    /// Where hosts fetch it.
    pub url: String,
    /// Hex SHA-256.
    pub sha256: String,
    /// `raw`, `qcow2` or `iso`.
    pub format: String,
    /// Vetted by the operator.
    #[serde(default)]
    pub verified: bool,
}

/// Registers (or re-registers) an image.
pub async fn register_image(ctx: &Ctx, input: RegisterImage) -> Result<Value, CommandError> {
    check_name("imageId", &input.image_id)?;
    if !(input.url.starts_with("http://")
        || input.url.starts_with("https://")
        || input.url.starts_with("file://"))
    {
        return Err(invalid("url", "an http(s):// or file:// URL"));
    }
    if input.sha256.len() != 64 || !input.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(invalid("sha256", "64 hex characters"));
    }
    if !["raw", "qcow2", "iso"].contains(&input.format.as_str()) {
        return Err(invalid("format", "raw, qcow2 or iso"));
    }
    let mut tx = ctx.pool.begin().await?;
    let version: Option<i64> = sqlx::query_scalar("SELECT version FROM images WHERE id = $1")
        .bind(&input.image_id)
        .fetch_optional(&mut *tx)
        .await?;
    let expected = version
        .map(ExpectedVersion::Exact)
        .unwrap_or(ExpectedVersion::NoStream);
    let event = ImageRegistered {
        image_id: input.image_id.clone(),
        tenant_id: input.tenant_id.clone(),
        url: input.url,
        sha256: input.sha256.to_lowercase(),
        format: input.format,
        verified: input.verified,
    };
    record_one(
        &mut tx,
        &format!("image-{}", input.image_id),
        expected,
        "image.registered",
        &event,
        &ctx.metadata(input.tenant_id.as_deref()),
    )
    .await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(serde_json::to_value(&event).expect("serialises"))
}

/// Deletes an image (instances already created from it keep running).
pub async fn delete_image(ctx: &Ctx, image_id: &str) -> Result<Value, CommandError> {
    let mut tx = ctx.pool.begin().await?;
    let event = ImageDeleted {
        image_id: image_id.into(),
    };
    let target = Flagged {
        table: "images",
        flag: "deleted",
        kind: "image",
        id: image_id,
    };
    record_unless_flagged(ctx, &mut tx, &target, "image.deleted", &event).await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(serde_json::json!({ "id": image_id, "deleted": true }))
}
