//! `sandboxes.create`: in one transaction, the template is read, the lifetime checked, a warm
//! instance claimed (or, when none is claimable, one admitted exactly like a hosted
//! `instances.create`), and `sandbox.created` appended. A refusal leaves nothing behind.

use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use vps_domain::authz::SandboxDraft;
use vps_domain::instance::Instance;
use vps_domain::sandbox::{self as domain, CreateSandbox, Lifecycle, OnTimeout, Sandbox};
use vps_domain::state_table::DesiredState;
use vps_domain::template::{self, Template};
use vps_domain::DomainError;
use vps_projections::node_specs::Moved;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::instances::{admit_in, Origin};
use crate::pipeline::{load, record_existing, transaction};

use super::template_instance::{instance_input, origin};
use vps_domain::ids::TemplateId;

/// `sandboxes.create` (without `wait`, which the API handles).
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSandboxInput {
    /// The tenant.
    pub tenant_id: String,
    /// `sbxt_…`.
    pub template_id: TemplateId,
    /// 1 to the template's `maxTtlSeconds` (default: its `defaultTtlSeconds`).
    pub ttl_seconds: Option<u64>,
    /// Makes the create idempotent.
    pub idempotency_key: String,
    /// Restores this snapshot (`snap_…`) of the caller's: never a warm claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// What the end of its lifetime does: `delete` or `pause` (default: the template's).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "vps_domain::sandbox::on_timeout_field"
    )]
    pub on_timeout: Option<vps_domain::sandbox::OnTimeout>,
    /// Its labels: at most 32, Kubernetes label syntax.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<vps_domain::labels::Labels>,
}

/// What a create decided, for the caller's metrics and authorization.
#[derive(Debug, Clone)]
pub struct Created {
    /// The sandbox.
    pub sandbox: Sandbox,
    /// Whether this call admitted it (false: a replay).
    pub new: bool,
}

/// The decision on what a `sandboxes.create` would make: the sandbox id and its draft (the
/// template's flavor shape, lifetime, warm, snapshot), asked inside the transaction that
/// admits it, on what that transaction read, so a racing template update cannot change the
/// shape after the decision.
pub type Policy<'a> = &'a (dyn Fn(&str, &SandboxDraft) -> Result<(), DomainError> + Sync);

/// The [`Policy`] of creates authorized before (tests, internal callers).
pub fn authorized_before(_: &str, _: &SandboxDraft) -> Result<(), DomainError> {
    Ok(())
}

/// Creates a sandbox, or answers the one this idempotency key already made.
#[tracing::instrument(name = "sandbox_create", skip_all)]
pub async fn create(
    ctx: &Ctx,
    input: CreateSandboxInput,
    policy: Policy<'_>,
) -> Result<Created, CommandError> {
    let id = vps_domain::ids::sandbox_id(vps_domain::ids::Origin {
        tenant: &input.tenant_id,
        caller: &ctx.actor.identity,
        key: &input.idempotency_key,
    });
    let request = CreateSandbox {
        id: id.clone(),
        tenant_id: input.tenant_id.clone(),
        template_id: input.template_id.to_string(),
        ttl_seconds: input.ttl_seconds,
        idempotency_key: input.idempotency_key.clone(),
        request_hash: crate::record::request_hash(&input),
        owner_identity_id: ctx.actor.identity.clone(),
        from_snapshot: input.from_snapshot.clone(),
        on_timeout: input.on_timeout,
        labels: input.labels.clone().unwrap_or_default(),
    };
    let (created, moved) = transaction(ctx, &id, async |tx| {
        create_in(ctx, tx, &request, policy).await
    })
    .await?;
    if let Some(moved) = moved {
        vps_projections::spec_signals::announce(&ctx.notifier, &ctx.spec_signals, &moved);
    }
    Ok(created)
}

/// The create in `tx`: a replay of the sandbox the key already made, or a new one with the
/// node spec a warm claim or a restore moved (announced once committed).
async fn create_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    c: &CreateSandbox,
    policy: Policy<'_>,
) -> Result<(Created, Option<Moved>), CommandError> {
    if let Some(existing) = load::<Sandbox>(tx, &c.id).await? {
        let sandbox = domain::replay(&existing, c)?;
        return Ok((
            Created {
                sandbox,
                new: false,
            },
            None,
        ));
    }
    let stored = super::template(tx, &c.template_id).await?;
    let t = template::live(stored.as_ref(), &c.tenant_id, &c.template_id)?;
    let on_timeout = c.on_timeout.unwrap_or(t.spec.on_timeout);
    if on_timeout == OnTimeout::Pause && !template::can_pause(&t.runtime) {
        return Err(DomainError::invalid_input(
            "onTimeout",
            format!(
                "the template's runtime {} cannot pause a guest; use delete",
                t.runtime
            ),
        )
        .into());
    }
    let c = &CreateSandbox {
        on_timeout: Some(on_timeout),
        ..c.clone()
    };
    let ttl_seconds = domain::admit(c, t.spec.default_ttl_seconds, t.spec.max_ttl_seconds)?;
    // The flavor as this transaction reads it: an archived or missing one is refused, never
    // decided without its shape.
    let shape = crate::instances::facts::flavor_shape(tx, &t.pool_id, &t.spec.flavor)
        .await?
        .ok_or_else(|| DomainError::NotFound {
            what: format!("flavor {}", t.spec.flavor),
        })?;
    let draft = SandboxDraft {
        template_id: t.id.clone(),
        ttl_seconds: i64::try_from(ttl_seconds).unwrap_or(i64::MAX),
        warm: t.spec.warm.is_some_and(|w| w.max > 0),
        vcpu: shape.vcpu,
        memory_gib: shape.memory_gib,
        gpus: shape.gpu_count(),
        disk_gib: shape.disk_gib,
        from_snapshot: c.from_snapshot.clone(),
        labels: c.labels.clone(),
    };
    policy(&c.id, &draft)?;
    // A restore boots its snapshot: it never claims a warm instance.
    let restore = match &c.from_snapshot {
        Some(snap) => Some(
            super::snapshots::restore_from(ctx, tx, &c.tenant_id, snap, &t.id, &t.runtime).await?,
        ),
        None => None,
    };
    let claimed = match restore {
        Some(_) => None,
        None => super::warm::claim(ctx, tx, t, &c.id).await?,
    };
    let warm = claimed.is_some();
    let (instance, moved) = match claimed {
        Some((claimed, moved)) => {
            // A warm instance takes its sandbox's labels (a cold one is created with them), so
            // its usage records carry them.
            let label = vps_domain::instance::InstanceCommand::SetLabels(c.labels.clone());
            let now = ctx.clock.now();
            let labeled = crate::pipeline::apply_commands(ctx, tx, &claimed, &[label], now).await?;
            (labeled.unwrap_or(claimed), Some(moved))
        }
        None => {
            let restoring = restore.is_some();
            let instance = cold(ctx, tx, t, c, restore).await?;
            // A restore, like a warm claim, is ready in well under a second: its host reads
            // its entry at once rather than a follower's pass later. A boot takes seconds, and
            // leaves its entry to the follower.
            let moved = if restoring {
                Some(vps_projections::node_specs::write_inline(tx, &instance.id).await?)
            } else {
                None
            };
            (instance, moved)
        }
    };
    let ids = Lifecycle {
        sandbox_id: c.id.clone(),
        tenant_id: c.tenant_id.clone(),
        template_id: t.id.clone(),
        instance_id: instance.id.clone(),
        pool_id: instance.pool_id.clone(),
    };
    let event = domain::created_event(c, ids, warm, ttl_seconds, ctx.clock.now());
    let sandbox =
        record_existing::<Sandbox>(ctx, tx, &c.id, None, vec![event], Some(&c.tenant_id)).await?;
    Ok((Created { sandbox, new: true }, moved))
}

/// Admits a new instance for the sandbox, as a hosted `instances.create` would.
async fn cold(
    ctx: &Ctx,
    tx: &mut PgConnection,
    t: &Template,
    c: &CreateSandbox,
    restore_from: Option<vps_domain::instance::RestoreFrom>,
) -> Result<Instance, CommandError> {
    let sandbox_id = c.id.as_str();
    let id = vps_domain::ids::instance_id(vps_domain::ids::Origin {
        tenant: &t.tenant_id,
        caller: sandbox_id,
        key: "sandbox",
    });
    let origin = Origin {
        sandbox_id: Some(sandbox_id.to_string()),
        restore_from,
        // First: the volumes' rows are locked before the node and the quota rows.
        volumes: crate::volumes::attach(tx, t).await?,
        ..origin(ctx, tx, t).await?
    };
    let mut input = instance_input(t, sandbox_id, DesiredState::Running);
    input.labels = Some(c.labels.clone()).filter(|l| !l.is_empty());
    admit_in(
        ctx,
        tx,
        &id,
        &input,
        &origin,
        &vps_domain::instance::authorized_before,
    )
    .await
}
