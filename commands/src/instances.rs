//! Instances: admission (`create`), `start`, `stop`, `resize` and `delete`. Each loads the
//! instance, decides with `vps_domain::instance::decide` and records the events; admission
//! also books quota, a node and an address in the same transaction, under row locks, so
//! concurrent creates can never overbook any of them.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use chrono::Utc;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::instance::{
    decide, evolve, CreateInstance, Instance, InstanceCommand, InstanceEvent, PlaceInstance,
    PoolKind, Requester, ResizeInstance,
};
use vps_domain::placement::{place, NodeCandidate, NodeState, PlacementRequest};
use vps_domain::quota::{charge_of, check, resize_delta, Amounts};
use vps_domain::resources::{Capacity, QuotaResource, Shape};
use vps_domain::state_table::DesiredState;
use vps_domain::DomainError;
use vps_events::ExpectedVersion;
use vps_projections::instances::load;

use crate::context::Ctx;
use crate::error::{retrying, CommandError};
use crate::record::{new_id, record};
use crate::secrets;

/// `instances.create` (without `wait`, which the API handles).
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateInput {
    /// The tenant.
    pub tenant_id: String,
    /// The pool (offered to the tenant).
    pub pool_id: String,
    /// The flavor's name in the pool.
    pub flavor: String,
    /// The image (hosted pools).
    pub image_id: String,
    /// OpenSSH public keys.
    #[serde(default)]
    pub ssh_keys: Vec<String>,
    /// Cloud-init user data; default: rendered from the id and keys.
    pub user_data: Option<String>,
    /// The project.
    pub project_id: Option<String>,
    /// `running` (default) or `stopped`.
    pub desired_state: Option<DesiredState>,
    /// Makes the create idempotent.
    pub idempotency_key: String,
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

/// The hash that tells a replay from a conflicting reuse of an idempotency key.
pub fn request_hash(input: &CreateInput) -> String {
    hex::encode(Sha256::digest(
        serde_json::to_vec(input).expect("serialises"),
    ))
}

/// Validates, then admits an instance (or returns the one this key already made).
pub async fn create(ctx: &Ctx, input: CreateInput) -> Result<Instance, CommandError> {
    if input.idempotency_key.is_empty() || input.idempotency_key.len() > 200 {
        return Err(invalid("idempotencyKey", "1 to 200 characters"));
    }
    if input.ssh_keys.len() > 32 {
        return Err(invalid("sshKeys", "at most 32 keys"));
    }
    for (i, key) in input.ssh_keys.iter().enumerate() {
        vps_domain::ssh_keys::validate_ssh_public_key(key).map_err(|e| match e {
            DomainError::InvalidInput { message, .. } => invalid(&format!("sshKeys[{i}]"), message),
            other => CommandError::Domain(other),
        })?;
    }
    if input
        .user_data
        .as_ref()
        .is_some_and(|u| u.len() > 64 * 1024)
    {
        return Err(invalid("userData", "at most 64 KiB"));
    }
    if matches!(
        input.desired_state,
        Some(DesiredState::Deleted) | Some(DesiredState::Paused)
    ) {
        return Err(invalid("desiredState", "running or stopped"));
    }
    let id = vps_domain::ids::instance_id(
        &input.tenant_id,
        &ctx.actor.identity,
        &input.idempotency_key,
    );
    retrying(&id, || admit(ctx, &id, &input)).await
}

async fn admit(ctx: &Ctx, id: &str, input: &CreateInput) -> Result<Instance, CommandError> {
    let hash = request_hash(input);
    let mut tx = ctx.pool.begin().await?;
    if let Some(existing) = load(&mut tx, id).await? {
        if existing.request_hash == hash {
            return Ok(existing);
        }
        return Err(CommandError::Domain(DomainError::Conflict {
            instance_id: id.into(),
        }));
    }
    let pool = sqlx::query(
        "SELECT p.class, p.runtime, p.provider_account_id, p.ip_cidr, p.ip_gateway FROM pools p
          WHERE p.id = $1 AND EXISTS (SELECT 1 FROM quotas q WHERE q.pool_id = p.id AND q.tenant_id = $2 AND q.offered)",
    )
    .bind(&input.pool_id)
    .bind(&input.tenant_id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| not_found(format!("pool {}", input.pool_id)))?;
    let class: String = pool.get(0);
    let kind = match class.as_str() {
        "vps-host" => PoolKind::Hosted,
        "provider" => PoolKind::Provider,
        _ => return Err(invalid("poolId", "not a vps-host or provider pool")),
    };
    let flavor =
        sqlx::query("SELECT shape FROM flavors WHERE pool_id = $1 AND name = $2 AND NOT archived")
            .bind(&input.pool_id)
            .bind(&input.flavor)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| not_found(format!("flavor {}", input.flavor)))?;
    let Json(shape): Json<Shape> = flavor.get(0);
    match kind {
        PoolKind::Hosted => {
            let visible: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM images WHERE id = $1 AND NOT deleted AND (tenant_id = $2 OR tenant_id IS NULL))",
            )
            .bind(&input.image_id)
            .bind(&input.tenant_id)
            .fetch_one(&mut *tx)
            .await?;
            if !visible {
                return Err(not_found(format!("image {}", input.image_id)));
            }
        }
        PoolKind::Provider => {
            if pool.get::<Option<String>, _>(2).is_none() {
                return Err(CommandError::Domain(DomainError::InvalidState {
                    message: format!("pool {} has no provider account", input.pool_id),
                }));
            }
        }
    }
    // A first look without locks refuses what cannot fit; the exact check runs after the
    // charge, when this transaction holds the quota rows, so they stay locked only briefly.
    let charge = charge_of(&shape);
    check_quota(
        &mut tx,
        &input.pool_id,
        &input.tenant_id,
        &charge,
        Charged::No,
    )
    .await?;

    let user_data_ref = secrets::user_data_ref(id);
    let user_data = input.user_data.clone().unwrap_or_else(|| {
        vps_domain::cloud_config::render_cloud_config(
            &vps_domain::ids::hostname_for(id),
            &input.ssh_keys,
        )
    });
    secrets::seal(
        &mut tx,
        &ctx.secrets,
        &user_data_ref,
        id,
        user_data.as_bytes(),
    )
    .await?;

    let now = Utc::now();
    let create = InstanceCommand::Create(Box::new(CreateInstance {
        id: id.into(),
        tenant_id: input.tenant_id.clone(),
        pool_id: input.pool_id.clone(),
        pool_kind: kind,
        flavor: input.flavor.clone(),
        shape: shape.clone(),
        image_id: input.image_id.clone(),
        ssh_keys: input.ssh_keys.clone(),
        user_data_ref: Some(user_data_ref),
        project_id: input.project_id.clone(),
        desired_state: input.desired_state.unwrap_or(DesiredState::Running),
        owner_identity_id: ctx.actor.identity.clone(),
        idempotency_key: input.idempotency_key.clone(),
        request_hash: hash,
        sandbox_id: None,
        warm_template_id: None,
    }));
    // Create and place are decided in memory and recorded as one append.
    let mut events = decide(None, &create, now)?;
    if kind == PoolKind::Hosted {
        let created = events
            .iter()
            .try_fold(None, |state, e| evolve(state, e, now).map(Some))
            .map_err(|e| DomainError::InvalidState {
                message: e.to_string(),
            })?
            .expect("a create decides at least one event");
        let runtime: Option<String> = pool.get(1);
        let range = pool
            .get::<Option<String>, _>(3)
            .zip(pool.get::<Option<String>, _>(4));
        let command = placement(
            &mut tx,
            &created,
            runtime.as_deref().unwrap_or("libvirt-kvm"),
            range,
        )
        .await?;
        events.extend(decide(Some(&created), &command, now)?);
    }
    let instance = apply(ctx, &mut tx, None, events).await?;
    confirm_placement(&mut tx, &instance).await?;
    check_quota(
        &mut tx,
        &input.pool_id,
        &input.tenant_id,
        &charge,
        Charged::Yes,
    )
    .await?;
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(instance)
}

/// Chooses a node and an address for a scheduling instance, or says why nothing fits.
///
/// The pool's nodes are read without locks. The choice is confirmed by [`confirm_placement`]
/// at the end of the transaction, which locks only the chosen node: placements on different
/// nodes never wait for each other, and those on the same node only for each other's commit.
pub async fn placement(
    tx: &mut PgConnection,
    instance: &Instance,
    runtime: &str,
    range: Option<(String, String)>,
) -> Result<InstanceCommand, CommandError> {
    let excluded = instance.excluded_nodes(Utc::now());
    let nodes = candidates(tx, &instance.pool_id, None).await?;
    let request = PlacementRequest {
        shape: &instance.shape,
        runtime,
        required_labels: &BTreeMap::new(),
        excluded: &excluded,
        only_nodes: None,
    };
    match place(&request, &nodes) {
        Ok(node) => lease_command(tx, instance, node, range).await,
        Err(why) => Ok(InstanceCommand::MarkUnschedulable(why)),
    }
}

/// Checks, holding the node's lock until commit, that the node an instance was just placed on
/// still holds every booking (its own included). When a concurrent placement took the room
/// first, the transaction must be decided again.
pub async fn confirm_placement(
    tx: &mut PgConnection,
    instance: &Instance,
) -> Result<(), CommandError> {
    let Some(node_id) = &instance.node_id else {
        return Ok(());
    };
    let node = candidates(tx, &instance.pool_id, Some(node_id)).await?;
    let fits = node.first().is_some_and(|n| n.capacity.holds(&n.allocated));
    if fits {
        Ok(())
    } else {
        Err(CommandError::Raced(format!(
            "node {node_id} filled up meanwhile"
        )))
    }
}

/// The pool's nodes with what is booked on them; with `lock`, only that node, locked.
async fn candidates(
    tx: &mut PgConnection,
    pool_id: &str,
    lock: Option<&str>,
) -> Result<Vec<NodeCandidate>, CommandError> {
    let nodes = match lock {
        None => "SELECT * FROM nodes WHERE pool_id = $1",
        Some(_) => "SELECT * FROM nodes WHERE pool_id = $1 AND id = $2 FOR UPDATE",
    };
    let rows = sqlx::query(&format!(
        "SELECT n.id, n.state, n.runtimes, n.labels, n.capacity,
                coalesce(sum(a.vcpu), 0)::bigint, coalesce(sum(a.memory_gib), 0)::bigint,
                coalesce(sum(a.disk_gib), 0)::bigint,
                coalesce(jsonb_object_agg(a.gpu_model, a.gpus) FILTER (WHERE a.gpus > 0), '{{}}')
           FROM ({nodes}) n
           LEFT JOIN node_allocations a ON a.node_id = n.id
          GROUP BY n.id, n.state, n.runtimes, n.labels, n.capacity"
    ))
    .bind(pool_id)
    .bind(lock)
    .fetch_all(&mut *tx)
    .await?;
    let nodes = rows
        .iter()
        .map(|r| {
            let Json(runtimes): Json<Vec<String>> = r.get(2);
            let Json(labels): Json<BTreeMap<String, String>> = r.get(3);
            let Json(capacity): Json<Capacity> = r.get(4);
            let Json(gpus): Json<BTreeMap<String, i64>> = r.get(8);
            NodeCandidate {
                id: r.get(0),
                state: match r.get::<String, _>(1).as_str() {
                    "ready" => NodeState::Ready,
                    "unreachable" => NodeState::Unreachable,
                    "lost" => NodeState::Lost,
                    _ => NodeState::Cordoned,
                },
                runtimes,
                labels,
                capacity,
                allocated: Capacity {
                    vcpu: r.get::<i64, _>(5) as u32,
                    memory_gib: r.get::<i64, _>(6) as u32,
                    disk_gib: r.get::<i64, _>(7) as u32,
                    gpus: gpus
                        .into_iter()
                        .map(|(model, count)| vps_domain::resources::Gpus {
                            model,
                            count: count as u32,
                        })
                        .collect(),
                },
            }
        })
        .collect();
    Ok(nodes)
}

/// Leases the lowest free address for an instance going to `node_id`.
///
/// "Lowest free first" means two concurrent placements would pick the same address; rather
/// than let them collide and retry in a herd, address choice in a pool is serialized with a
/// transaction-scoped advisory lock (held to commit; the lease's key still guards it).
async fn lease_command(
    tx: &mut PgConnection,
    instance: &Instance,
    node_id: String,
    range: Option<(String, String)>,
) -> Result<InstanceCommand, CommandError> {
    let (cidr, gateway) = range.ok_or_else(|| {
        CommandError::Domain(DomainError::CapacityUnavailable {
            resource: "ipv4".into(),
        })
    })?;
    let cidr = vps_domain::ipam::Ipv4Cidr::parse(&cidr)?;
    let gateway: Ipv4Addr = gateway
        .parse()
        .map_err(|_| invalid("gateway", "stored gateway is not IPv4"))?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('ip-lease:' || $1, 0))")
        .bind(&instance.pool_id)
        .execute(&mut *tx)
        .await?;
    // The domain says which addresses are leasable; the database finds the lowest of them
    // that is free without shipping every lease: the first host, or right after a taken
    // address (a lease or the gateway) whose successor is free. One sort, no per-candidate
    // lookups, so a table without statistics yet cannot make it quadratic.
    let first = Ipv4Addr::from(u32::from(cidr.network()) + 1);
    let last = Ipv4Addr::from(u32::from(cidr.broadcast()) - 1);
    let found: Option<String> = sqlx::query_scalar(
        "WITH taken AS (
             SELECT inet(address) AS a FROM ip_leases WHERE pool_id = $1
             UNION ALL SELECT $4::inet
         ), ordered AS (
             SELECT a, lead(a) OVER (ORDER BY a) AS next FROM taken
              WHERE a BETWEEN $2::inet AND $3::inet
         )
         SELECT host(c) FROM (
             SELECT $2::inet AS c WHERE NOT EXISTS (SELECT 1 FROM taken WHERE a = $2::inet)
             UNION ALL
             SELECT a + 1 FROM ordered WHERE (next IS NULL OR next > a + 1) AND a + 1 <= $3::inet
         ) gaps
         ORDER BY c LIMIT 1",
    )
    .bind(&instance.pool_id)
    .bind(first.to_string())
    .bind(last.to_string())
    .bind(gateway.to_string())
    .fetch_optional(&mut *tx)
    .await?;
    let address = found
        .and_then(|a| a.parse::<Ipv4Addr>().ok())
        .filter(|a| cidr.is_host(*a) && *a != gateway)
        .ok_or_else(|| DomainError::CapacityUnavailable {
            resource: "ipv4".into(),
        })?;
    Ok(InstanceCommand::Place(PlaceInstance {
        node_id,
        allocation_id: new_id("alloc"),
        address: address.to_string(),
    }))
}

/// Whether the quota rows already hold this transaction's charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Charged {
    /// Not yet: a first look, without locks.
    No,
    /// Yes: the projector's update locked the rows; the usage read includes the charge.
    Yes,
}

/// Checks that `delta` fits the tenant's quota in the pool.
async fn check_quota(
    tx: &mut PgConnection,
    pool_id: &str,
    tenant_id: &str,
    delta: &BTreeMap<QuotaResource, i64>,
    charged: Charged,
) -> Result<(), CommandError> {
    let rows =
        sqlx::query("SELECT resource, max, used FROM quotas WHERE pool_id = $1 AND tenant_id = $2")
            .bind(pool_id)
            .bind(tenant_id)
            .fetch_all(&mut *tx)
            .await?;
    let mut max = Amounts::new();
    let mut used = Amounts::new();
    for r in &rows {
        if let Some(resource) = QuotaResource::parse(&r.get::<String, _>(0)) {
            let charge = if charged == Charged::Yes {
                delta.get(&resource).copied().unwrap_or(0)
            } else {
                0
            };
            max.insert(resource, r.get::<i64, _>(1).max(0) as u64);
            used.insert(resource, (r.get::<i64, _>(2) - charge).max(0) as u64);
        }
    }
    check(&max, &used, delta)?;
    Ok(())
}

/// Records `events` on the instance's stream and returns the instance after them.
async fn apply(
    ctx: &Ctx,
    tx: &mut PgConnection,
    before: Option<&Instance>,
    events: Vec<InstanceEvent>,
) -> Result<Instance, CommandError> {
    let Some(first) = events.first() else {
        return Ok(before
            .cloned()
            .expect("no events only for an existing instance"));
    };
    let id = first.instance_id().to_string();
    let tenant = first.common().tenant_id.clone();
    let expected = match before {
        None => ExpectedVersion::NoStream,
        Some(b) => ExpectedVersion::Exact(b.version as i64),
    };
    let pairs = events
        .iter()
        .map(|e| (e.event_type().to_string(), e.data()))
        .collect();
    let stored = record(
        tx,
        &format!("instance-{id}"),
        expected,
        pairs,
        &ctx.metadata(Some(&tenant)),
    )
    .await?;
    if events
        .iter()
        .any(|e| matches!(e, InstanceEvent::Deleted(_)))
    {
        secrets::forget(tx, &id).await?;
    }
    // The instance as the projector just stored it: the same fold, without reading it back.
    let mut state = before.cloned();
    for (event, recorded) in events.iter().zip(&stored) {
        let next =
            evolve(state, event, recorded.recorded_at).map_err(|e| DomainError::InvalidState {
                message: e.to_string(),
            })?;
        state = Some(next);
    }
    Ok(state.expect("at least one event"))
}

/// Loads an instance the caller may see: another tenant's is `NOT_FOUND`.
pub async fn visible(
    tx: &mut PgConnection,
    tenant_id: &str,
    instance_id: &str,
) -> Result<Instance, CommandError> {
    match load(tx, instance_id).await? {
        Some(i) if i.tenant_id == tenant_id => Ok(i),
        _ => Err(not_found(format!("instance {instance_id}"))),
    }
}

/// What a tenant asks of an existing instance.
#[derive(Debug, Clone)]
pub enum Change {
    /// Desired running.
    Start,
    /// Desired stopped.
    Stop,
    /// Desired deleted.
    Delete,
    /// A new flavor (stopped, hosted).
    Resize(String),
}

/// Applies a tenant's change to an instance and returns it.
pub async fn change(
    ctx: &Ctx,
    tenant_id: &str,
    instance_id: &str,
    change: Change,
) -> Result<Instance, CommandError> {
    retrying(instance_id, || {
        change_once(ctx, tenant_id, instance_id, &change)
    })
    .await
}

async fn change_once(
    ctx: &Ctx,
    tenant_id: &str,
    instance_id: &str,
    change: &Change,
) -> Result<Instance, CommandError> {
    let mut tx = ctx.pool.begin().await?;
    let instance = visible(&mut tx, tenant_id, instance_id).await?;
    let command = match change {
        Change::Start => InstanceCommand::Start {
            requester: Requester::Api,
        },
        Change::Stop => InstanceCommand::Stop {
            requester: Requester::Api,
        },
        Change::Delete => InstanceCommand::Delete {
            requester: Requester::Api,
            reason: None,
        },
        Change::Resize(flavor) => resize_command(&mut tx, &instance, flavor).await?,
    };
    let events = decide(Some(&instance), &command, Utc::now())?;
    let after = apply(ctx, &mut tx, Some(&instance), events).await?;
    if matches!(change, Change::Resize(_)) {
        let growth = resize_delta(&instance.shape, &after.shape);
        check_quota(
            &mut tx,
            &after.pool_id,
            &after.tenant_id,
            &growth,
            Charged::Yes,
        )
        .await?;
    }
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(after)
}

/// Resolves the new flavor and books its growth (quota, then the node) before deciding.
async fn resize_command(
    tx: &mut PgConnection,
    instance: &Instance,
    flavor: &str,
) -> Result<InstanceCommand, CommandError> {
    let row =
        sqlx::query("SELECT shape FROM flavors WHERE pool_id = $1 AND name = $2 AND NOT archived")
            .bind(&instance.pool_id)
            .bind(flavor)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| not_found(format!("flavor {flavor}")))?;
    let Json(shape): Json<Shape> = row.get(0);
    let command = InstanceCommand::Resize(ResizeInstance {
        flavor: flavor.into(),
        shape: shape.clone(),
    });
    // Let the decision refuse what the domain refuses (provider pool, GPUs, state) first.
    decide(Some(instance), &command, Utc::now())?;
    check_quota(
        tx,
        &instance.pool_id,
        &instance.tenant_id,
        &resize_delta(&instance.shape, &shape),
        Charged::No,
    )
    .await?;
    if let Some(node_id) = &instance.node_id {
        let node = sqlx::query(
            "SELECT n.capacity, coalesce(sum(a.vcpu), 0)::bigint, coalesce(sum(a.memory_gib), 0)::bigint, coalesce(sum(a.disk_gib), 0)::bigint
               FROM (SELECT * FROM nodes WHERE id = $1 FOR UPDATE) n LEFT JOIN node_allocations a ON a.node_id = n.id
              GROUP BY n.capacity",
        )
        .bind(node_id)
        .fetch_one(&mut *tx)
        .await?;
        let Json(capacity): Json<Capacity> = node.get(0);
        let allocated = Capacity {
            vcpu: node.get::<i64, _>(1) as u32,
            memory_gib: node.get::<i64, _>(2) as u32,
            disk_gib: node.get::<i64, _>(3) as u32,
            gpus: Vec::new(),
        };
        vps_domain::placement::check_resize_in_place(
            &capacity,
            &allocated,
            &instance.shape,
            &shape,
        )?;
    }
    Ok(command)
}
