//! Instances: admission (`create`), `start`, `stop`, `resize` and `delete`. Each reads its
//! facts ([`facts`]), decides with `vps_domain::instance` and records the events through the
//! [`crate::pipeline`]; admission and resize then confirm, under row locks held to commit, that
//! the quota and the node still hold what they booked, so concurrent commands never overbook.

pub mod batch;
pub mod facts;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use vps_domain::instance::{
    self as domain, Admission, CreateInstance, Instance, InstanceCommand, PoolKind, Requester,
};
use vps_domain::quota::{charge_of, resize_delta};
use vps_domain::resources::Shape;
use vps_domain::state_table::DesiredState;
use vps_domain::DomainError;
use vps_projections::instances::load;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{record_instance, transaction};
use crate::record::new_id;
use crate::secrets;

pub use batch::{Admitter, Gate};
pub use facts::confirm_placement;

/// The most SSH keys a create names.
pub const MAX_SSH_KEYS: usize = 32;

/// `sshKeys`: at most [`MAX_SSH_KEYS`].
fn ssh_keys<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    vps_domain::bounds::list::<D, String, MAX_SSH_KEYS>(d)
        .map_err(|e| vps_domain::bounds::in_field("sshKeys", e))
}

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
    /// OpenSSH public keys: at most 32.
    #[serde(default, deserialize_with = "ssh_keys")]
    #[schemars(length(max = 32))]
    pub ssh_keys: Vec<String>,
    /// Cloud-init user data; default: rendered from the id and keys.
    pub user_data: Option<String>,
    /// The project.
    pub project_id: Option<String>,
    /// `running` (default) or `stopped`.
    pub desired_state: Option<DesiredState>,
    /// Makes the create idempotent.
    pub idempotency_key: String,
    /// Its labels: at most 32, Kubernetes label syntax.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<vps_domain::labels::Labels>,
}

/// The hash that tells a replay from a conflicting reuse of an idempotency key. It is keyed
/// (an HMAC under a key derived from the deployment key): `instance.created` carries it, and
/// a plain hash of a request that holds user data would let anyone who reads the log test
/// guesses of that user data.
pub fn request_hash(key: &secrets::SecretKey, input: &CreateInput) -> String {
    key.digest(
        "vps instances.create request v1",
        &serde_json::to_vec(input).expect("serialises"),
    )
}

/// Admits an instance if `policy` allows its draft, or answers the one this idempotency key
/// already made.
pub async fn create(
    ctx: &Ctx,
    input: CreateInput,
    policy: domain::Policy<'_>,
) -> Result<Instance, CommandError> {
    domain::check_user_data(input.user_data.as_deref())?;
    let id = instance_id(ctx, &input);
    transaction(ctx, &id, async |tx| {
        admit_in(ctx, tx, &id, &input, &Origin::default(), policy).await
    })
    .await
}

/// The instance id a create derives from (tenant, caller, idempotency key).
fn instance_id(ctx: &Ctx, input: &CreateInput) -> String {
    vps_domain::ids::instance_id(vps_domain::ids::Origin {
        tenant: &input.tenant_id,
        caller: &ctx.actor.identity,
        key: &input.idempotency_key,
    })
}

/// The instance's user data: given, or cloud-config rendered from its id and keys.
fn user_data(id: &str, input: &CreateInput) -> String {
    input.user_data.clone().unwrap_or_else(|| {
        vps_domain::cloud_config::render_cloud_config(
            &vps_domain::ids::hostname_for(id),
            &input.ssh_keys,
        )
    })
}

/// Who an instance is made for beyond a tenant's own create: a sandbox, or a template's warm
/// pool. The default is an ordinary `instances.create`.
#[derive(Debug, Clone, Default)]
pub struct Origin {
    /// The sandbox that will drive it.
    pub sandbox_id: Option<String>,
    /// The template whose warm pool it joins, with the template's instance version.
    pub warm: Option<(String, u64)>,
    /// The template's network rule.
    pub network_policy: Option<vps_domain::template::Network>,
    /// The template's allow-list and bounds.
    pub network_rules: vps_domain::template::NetworkRules,
    /// The owner, when not the caller (a warm instance belongs to its template's author).
    pub owner_identity_id: Option<String>,
    /// The user data to seal, when not the input's (a template's, with its environment).
    pub user_data: Option<String>,
    /// A restore: the snapshot the instance boots from.
    pub restore_from: Option<vps_domain::instance::RestoreFrom>,
    /// A sandbox's volumes (placement keeps the instance on their node).
    pub volumes: Vec<vps_domain::volume::Attachment>,
}

/// Admits an instance in the caller's transaction (a replay answers the existing one) if
/// `policy` allows its draft: the path every hosted create takes, sandboxes' and warm pools'
/// included.
pub async fn admit_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    id: &str,
    input: &CreateInput,
    origin: &Origin,
    policy: domain::Policy<'_>,
) -> Result<Instance, CommandError> {
    // What the input alone decides, before the reads: the command and the user data.
    let command = create_command(ctx, id, input, origin);
    let sealed = origin
        .user_data
        .clone()
        .unwrap_or_else(|| user_data(id, input));
    // The batch's facts, for a batch of one.
    let mut known = batch::Known::new(vec![id.to_string()]);
    let facts = known.facts(tx, id, input).await?;
    let now = ctx.clock.now();
    let events = match domain::admit(&facts, command, &new_id("alloc"), now, policy)? {
        Admission::Replay(existing) => return Ok(*existing),
        Admission::Admit(events) => events,
    };
    let placed = domain::fold_now(&events, now)?;
    // The node before the quota rows, locked and checked before the booking is written.
    let booking = placed
        .node_id
        .iter()
        .map(|n| (n.clone(), vec![&placed.shape]));
    facts::confirm_bookings(tx, &booking.collect()).await?;
    let reference = secrets::user_data_ref(id);
    secrets::seal(tx, &ctx.secrets, &reference, id, sealed.as_bytes()).await?;
    let instance = record_instance(ctx, tx, None, events).await?;
    let charge = charge_of(&instance.shape);
    facts::confirm_quota(tx, &input.pool_id, &input.tenant_id, &charge).await?;
    Ok(instance)
}

/// The domain's create command for `input`; admission fills in the pool kind and shape.
fn create_command(ctx: &Ctx, id: &str, input: &CreateInput, origin: &Origin) -> CreateInstance {
    CreateInstance {
        id: id.into(),
        tenant_id: input.tenant_id.clone(),
        pool_id: input.pool_id.clone(),
        pool_kind: PoolKind::Hosted,
        flavor: input.flavor.clone(),
        shape: Shape {
            vcpu: 0,
            memory_gib: 0,
            disk_gib: 0,
            gpus: None,
        },
        image_id: input.image_id.clone(),
        ssh_keys: input.ssh_keys.clone(),
        user_data_ref: Some(secrets::user_data_ref(id)),
        project_id: input.project_id.clone(),
        desired_state: input.desired_state.unwrap_or(DesiredState::Running),
        owner_identity_id: origin
            .owner_identity_id
            .clone()
            .unwrap_or_else(|| ctx.actor.identity.clone()),
        idempotency_key: input.idempotency_key.clone(),
        request_hash: request_hash(&ctx.secrets, input),
        sandbox_id: origin.sandbox_id.clone(),
        warm_template_id: origin.warm.as_ref().map(|(t, _)| t.clone()),
        template_version: origin.warm.as_ref().map(|(_, v)| *v),
        network_policy: origin.network_policy,
        network_rules: origin.network_rules.clone(),
        restore_from: origin.restore_from.clone(),
        volumes: origin.volumes.clone(),
        labels: input.labels.clone().unwrap_or_default(),
    }
}

/// Chooses a node and an address for a scheduling instance, or says why nothing fits. The
/// pool's nodes are read without locks; [`confirm_placement`] checks the choice at the end of
/// the transaction under the chosen node's lock, so placements on different nodes never wait
/// for each other. `now` stamps the placement.
pub async fn placement(
    tx: &mut PgConnection,
    instance: &Instance,
    now: DateTime<Utc>,
) -> Result<InstanceCommand, CommandError> {
    let (pool, facts) = facts::placement(tx, &instance.pool_id).await?;
    Ok(domain::placement(
        &facts,
        &pool,
        instance,
        &new_id("alloc"),
        now,
    )?)
}

/// Loads an instance the caller may see: another tenant's is `NOT_FOUND`.
pub async fn visible(
    tx: &mut PgConnection,
    tenant_id: &str,
    instance_id: &str,
) -> Result<Instance, CommandError> {
    owned_by(load(tx, instance_id).await?, tenant_id, instance_id)
}

/// The instance found, if `tenant_id` owns it; `NOT_FOUND` for a missing instance and for
/// another tenant's alike.
fn owned_by(
    found: Option<Instance>,
    tenant_id: &str,
    instance_id: &str,
) -> Result<Instance, CommandError> {
    match found {
        Some(i) if i.tenant_id == tenant_id => Ok(i),
        _ => Err(DomainError::NotFound {
            what: format!("instance {instance_id}"),
        }
        .into()),
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
    /// Deleted at once, without waiting for the host (`delete { force: true }`): everything
    /// released; a host that still holds it gets it back as an orphan.
    ForceDelete,
    /// Desired deleted by the control plane (tenant teardown), sandbox and warm instances
    /// too; `instance.deleting` carries the reason.
    DeleteBecause(String),
    /// A new flavor (stopped, hosted).
    Resize(String),
}

/// Replaces an instance's labels (`instance.labeled`); the same labels change nothing.
pub async fn set_labels(
    ctx: &Ctx,
    tenant_id: &str,
    instance_id: &str,
    labels: vps_domain::labels::Labels,
) -> Result<Instance, CommandError> {
    transaction(ctx, instance_id, async |tx| {
        let instance = owned_by(
            facts::lock_instance(tx, instance_id).await?,
            tenant_id,
            instance_id,
        )?;
        let command = InstanceCommand::SetLabels(labels.clone());
        let events = domain::decide(Some(&instance), &command, ctx.clock.now())?;
        record_instance(ctx, tx, Some(&instance), events).await
    })
    .await
}

/// Applies a tenant's change to an instance and returns it. A resize is decided by no
/// policy here: the API's goes through [`change_deciding`].
pub async fn change(
    ctx: &Ctx,
    tenant_id: &str,
    instance_id: &str,
    change: Change,
) -> Result<Instance, CommandError> {
    change_deciding(
        ctx,
        tenant_id,
        instance_id,
        change,
        &domain::authorized_before,
    )
    .await
}

/// Like [`change`], with a resize decided by `policy` on the instance as the target flavor
/// would leave it (`vcpu`, `memoryGiB`, `gpus`, `diskGiB`), read in the transaction that
/// records it. An archived or missing flavor is `NOT_FOUND`, never decided without its shape.
pub async fn change_deciding(
    ctx: &Ctx,
    tenant_id: &str,
    instance_id: &str,
    change: Change,
    policy: domain::Policy<'_>,
) -> Result<Instance, CommandError> {
    transaction(ctx, instance_id, async |tx| {
        change_in(ctx, tx, tenant_id, instance_id, &change, policy).await
    })
    .await
}

async fn change_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    tenant_id: &str,
    instance_id: &str,
    change: &Change,
    policy: domain::Policy<'_>,
) -> Result<Instance, CommandError> {
    if matches!(change, Change::Resize(_)) {
        // A resize locks its node: take it before the instance's row, in the common order.
        let node = visible(tx, tenant_id, instance_id).await?.node_id;
        facts::lock_nodes(tx, &node.into_iter().collect::<Vec<_>>()).await?;
    }
    let instance = owned_by(
        facts::lock_instance(tx, instance_id).await?,
        tenant_id,
        instance_id,
    )?;
    let now = ctx.clock.now();
    let requester = Requester::Api;
    let events = match change {
        Change::Start => {
            domain::decide(Some(&instance), &InstanceCommand::Start { requester }, now)?
        }
        Change::Stop => domain::decide(Some(&instance), &InstanceCommand::Stop { requester }, now)?,
        Change::Delete => {
            let delete = InstanceCommand::Delete {
                requester,
                reason: None,
            };
            domain::decide(Some(&instance), &delete, now)?
        }
        Change::ForceDelete => {
            let delete = InstanceCommand::ForceDelete {
                requester,
                reason: "force".into(),
            };
            domain::decide(Some(&instance), &delete, now)?
        }
        Change::DeleteBecause(reason) => {
            let delete = InstanceCommand::Delete {
                requester: Requester::System,
                reason: Some(reason.clone()),
            };
            domain::decide(Some(&instance), &delete, now)?
        }
        Change::Resize(flavor) => {
            let facts = facts::resize(tx, &instance, flavor).await?;
            // A missing or archived flavor is refused by `resize` below, never decided
            // without its shape.
            if let Some(shape) = &facts.shape {
                let image_verified =
                    vps_projections::images::verified(tx, &instance.image_id).await?;
                let draft = vps_domain::authz::InstanceDraft {
                    vcpu: shape.vcpu,
                    memory_gib: shape.memory_gib,
                    gpus: shape.gpu_count(),
                    disk_gib: shape.disk_gib,
                    image_id: instance.image_id.clone(),
                    image_verified: image_verified.unwrap_or(false),
                    project_id: instance.project_id.clone(),
                    labels: instance.labels.clone(),
                };
                policy(&instance.id, &draft)?;
            }
            domain::resize(&instance, flavor, &facts, now)?
        }
    };
    let after = record_instance(ctx, tx, Some(&instance), events).await?;
    if matches!(change, Change::Resize(_)) {
        let growth = resize_delta(&instance.shape, &after.shape);
        facts::confirm_quota(tx, &after.pool_id, &after.tenant_id, &growth).await?;
    }
    Ok(after)
}
