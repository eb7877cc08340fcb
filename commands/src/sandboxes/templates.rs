//! `sandboxTemplates.create/update/delete`: checked like a hosted `instances.create` (pool
//! offered and hosted, flavor, image), with `env` naming only the tenant's own secrets and
//! `volumes` only the tenant's own ready volumes of the pool.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use vps_domain::template::{
    self as domain, CreateTemplate, Network, NetworkSetting, Template, TemplateFacts, TemplateSpec,
    Warm, DEFAULT_MAX_TTL_SECONDS, DEFAULT_TTL_SECONDS,
};

use vps_domain::volume::{TemplateVolume, VolumeMount};

use crate::context::Ctx;
use crate::error::CommandError;
use crate::instances::{facts, CreateInput};
use crate::pipeline::{change_existing, record_existing, transaction};
use crate::record::new_id;
use crate::secrets;
use vps_domain::ids::{PoolId, TemplateId};

/// `sandboxTemplates.create`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateInput {
    /// The tenant.
    pub tenant_id: String,
    /// Unique among the tenant's live templates.
    pub name: String,
    /// A hosted pool offered to the tenant.
    pub pool_id: PoolId,
    /// The flavor's name in the pool.
    pub flavor: String,
    /// The image.
    pub image_id: String,
    /// Its labels: at most 32, Kubernetes label syntax.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<vps_domain::labels::Labels>,
    /// The settings given (the others take their defaults).
    #[serde(flatten)]
    pub settings: TemplateSettings,
}

/// `sandboxTemplates.update`: any of the spec's fields.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplatePatch {
    /// The tenant.
    pub tenant_id: String,
    /// `sbxt_…`.
    pub template_id: TemplateId,
    /// A new flavor.
    pub flavor: Option<String>,
    /// A new image.
    pub image_id: Option<String>,
    /// The settings given (the others stay as they are).
    #[serde(flatten)]
    pub settings: TemplateSettings,
}

/// A template's optional settings, as a create and an update take them: one that is absent
/// takes its default on a create and stays as it is on an update.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateSettings {
    /// User data every sandbox boots with (sealed, never shown again).
    pub user_data: Option<String>,
    /// `NAME` → `secret://<tenant>/<name>`: written to `/etc/sandbox/env` in the guest (at
    /// most 64).
    #[serde(default, deserialize_with = "bounded_env")]
    #[schemars(extend("maxProperties" = 64))]
    pub env: Option<BTreeMap<String, String>>,
    /// `egress` (default), `private` or `none`; or `{ mode?, allow?, bandwidthMbit?,
    /// maxConnections? }` to narrow `egress` to an allow-list and bound the guest's bandwidth
    /// and connections (the mode alone clears them).
    pub network: Option<NetworkSetting>,
    /// A sandbox's lifetime when its create names none (default 3600).
    pub default_ttl_seconds: Option<u64>,
    /// The longest lifetime, extensions included (default 86400).
    pub max_ttl_seconds: Option<u64>,
    /// Warm instances kept ready: `{ min, max }` (`max` 0 with volumes).
    pub warm: Option<Warm>,
    /// The tenant's volumes its sandboxes attach: at most 8, all on one node (`[]`: none).
    #[serde(default, deserialize_with = "bounded_volumes")]
    #[schemars(length(max = 8))]
    pub volumes: Option<Vec<VolumeMount>>,
    /// How long a paused sandbox is kept before it is deleted (default 604800, 7 days; at
    /// most 30 days).
    pub paused_ttl_seconds: Option<u64>,
    /// What the end of a sandbox's lifetime does: `delete` (default) or `pause`.
    #[serde(default, deserialize_with = "vps_domain::sandbox::on_timeout_field")]
    pub on_timeout: Option<vps_domain::sandbox::OnTimeout>,
    /// `exec` and `snapshot` on a paused sandbox resume it first (default false).
    pub auto_resume: Option<bool>,
    /// A ready sandbox whose guest stays under `idleCpuPercent` with no exec session and no
    /// preview request for this long is paused (`onTimeout: pause`) or expired (`reason:
    /// idle`): 60 to 604800 (7 days); absent on a create: never. Needs hosts that report
    /// their guests' CPU seconds.
    pub idle_timeout_seconds: Option<u64>,
    /// Below this share of one vCPU, in percent, the guest counts as idle: 0.1 to 100
    /// (default 2).
    pub idle_cpu_percent: Option<f64>,
}

/// `env`: at most [`domain::MAX_ENV`] entries.
fn bounded_env<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    vps_domain::bounds::optional_map::<D, String, { domain::MAX_ENV }>(d)
        .map_err(|e| vps_domain::bounds::in_field("env", e))
}

/// `volumes`: at most [`vps_domain::volume::MAX_MOUNTS`].
fn bounded_volumes<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<VolumeMount>>, D::Error> {
    vps_domain::bounds::optional_list::<D, VolumeMount, { vps_domain::volume::MAX_MOUNTS }>(d)
        .map_err(|e| vps_domain::bounds::in_field("volumes", e))
}

impl TemplateSettings {
    /// `spec` with the settings given here (user data as `user_data_ref`), the rest as they are;
    /// the volumes are left to [`mounts`], which resolves them.
    fn applied(&self, spec: TemplateSpec, user_data_ref: String) -> TemplateSpec {
        TemplateSpec {
            user_data_ref: self
                .user_data
                .as_ref()
                .map(|_| user_data_ref)
                .or(spec.user_data_ref),
            env: self.env.clone().unwrap_or(spec.env),
            network: self.network.as_ref().map_or(spec.network, |n| n.split().0),
            network_rules: self
                .network
                .as_ref()
                .map_or(spec.network_rules, |n| n.split().1),
            default_ttl_seconds: self.default_ttl_seconds.unwrap_or(spec.default_ttl_seconds),
            max_ttl_seconds: self.max_ttl_seconds.unwrap_or(spec.max_ttl_seconds),
            warm: self.warm.or(spec.warm),
            paused_ttl_seconds: self.paused_ttl_seconds.unwrap_or(spec.paused_ttl_seconds),
            on_timeout: self.on_timeout.unwrap_or(spec.on_timeout),
            auto_resume: self.auto_resume.unwrap_or(spec.auto_resume),
            idle_timeout_seconds: self.idle_timeout_seconds.or(spec.idle_timeout_seconds),
            idle_cpu_percent: self
                .idle_cpu_percent
                .map_or(spec.idle_cpu_percent, domain::CpuPercent),
            ..spec
        }
    }
}

/// The reference a template's user data is sealed under (one per instance version).
fn user_data_ref(template_id: &str, instance_version: u64) -> String {
    format!("secret://{template_id}/user-data-{instance_version}")
}

/// The default of `[limits] templates_per_tenant`.
pub const DEFAULT_TEMPLATES_PER_TENANT: usize = 200;

/// Creates a template, at most [`DEFAULT_TEMPLATES_PER_TENANT`] live ones per tenant.
pub async fn create(ctx: &Ctx, input: TemplateInput) -> Result<Template, CommandError> {
    create_bounded(ctx, input, DEFAULT_TEMPLATES_PER_TENANT).await
}

/// Creates a template unless the tenant already has `max` live ones (`INVALID_STATE`,
/// `details.reason: templates-per-tenant`): each template is a row every sandbox pass reads
/// and, with a warm pool, instances kept booted.
pub async fn create_bounded(
    ctx: &Ctx,
    input: TemplateInput,
    max: usize,
) -> Result<Template, CommandError> {
    vps_domain::instance::check_user_data(input.settings.user_data.as_deref())?;
    let id = new_id("sbxt");
    transaction(ctx, &id, async |tx| {
        create_in(ctx, tx, &id, &input, max).await
    })
    .await
}

async fn create_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    id: &str,
    input: &TemplateInput,
    max: usize,
) -> Result<Template, CommandError> {
    // Concurrent creates of one tenant queue here, so the count below is exact.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('sandbox-templates:' || $1, 0))")
        .bind(&input.tenant_id)
        .execute(&mut *tx)
        .await?;
    let live = vps_projections::sandboxes::live_template_count(&mut *tx, &input.tenant_id).await?;
    if usize::try_from(live).unwrap_or(usize::MAX) >= max {
        return Err(vps_domain::DomainError::InvalidState {
            message: format!(
                "tenant {} already has {live} templates, the most it may have ([limits] \
                 templates_per_tenant = {max}); delete one first",
                input.tenant_id
            ),
            details: serde_json::json!({ "reason": "templates-per-tenant", "max": max }),
        }
        .into());
    }
    let defaults = TemplateSpec {
        flavor: input.flavor.clone(),
        image_id: input.image_id.clone(),
        user_data_ref: None,
        env: BTreeMap::new(),
        network: Network::default(),
        network_rules: Default::default(),
        default_ttl_seconds: DEFAULT_TTL_SECONDS,
        max_ttl_seconds: DEFAULT_MAX_TTL_SECONDS,
        warm: None,
        volumes: Vec::new(),
        paused_ttl_seconds: vps_domain::sandbox::DEFAULT_PAUSED_TTL_SECONDS,
        on_timeout: Default::default(),
        auto_resume: false,
        idle_timeout_seconds: None,
        idle_cpu_percent: Default::default(),
    };
    let spec = input.settings.applied(defaults, user_data_ref(id, 1));
    let facts =
        template_facts(tx, &input.tenant_id, &input.pool_id, &spec, &input.name, id).await?;
    let spec = TemplateSpec {
        volumes: mounts(
            tx,
            &input.tenant_id,
            &input.pool_id,
            &input.settings.volumes,
            &facts,
        )
        .await?,
        ..spec
    };
    let events = domain::create(
        CreateTemplate {
            id: id.to_string(),
            tenant_id: input.tenant_id.clone(),
            name: input.name.clone(),
            pool_id: input.pool_id.to_string(),
            owner_identity_id: ctx.actor.identity.clone(),
            spec,
            labels: input.labels.clone().unwrap_or_default(),
        },
        &facts,
    )?;
    seal_user_data(ctx, tx, id, 1, input.settings.user_data.as_deref()).await?;
    record_existing::<Template>(ctx, tx, id, None, events, Some(&input.tenant_id)).await
}

/// Updates a template (its `version` rises; its `instanceVersion` too when the guest changes).
pub async fn update(ctx: &Ctx, patch: TemplatePatch) -> Result<Template, CommandError> {
    vps_domain::instance::check_user_data(patch.settings.user_data.as_deref())?;
    transaction(ctx, &patch.template_id, async |tx| {
        update_in(ctx, tx, &patch).await
    })
    .await
}

async fn update_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    p: &TemplatePatch,
) -> Result<Template, CommandError> {
    let before = super::template(tx, &p.template_id).await?;
    let t = domain::live(before.as_ref(), &p.tenant_id, &p.template_id)?;
    let version = t.instance_version + 1;
    let mut spec = p
        .settings
        .applied(t.spec.clone(), user_data_ref(&t.id, version));
    spec.flavor = p.flavor.clone().unwrap_or(spec.flavor);
    spec.image_id = p.image_id.clone().unwrap_or(spec.image_id);
    let facts = template_facts(tx, &t.tenant_id, &t.pool_id, &spec, &t.name, &t.id).await?;
    let volumes = &p.settings.volumes;
    if volumes.is_some() {
        spec.volumes = mounts(tx, &t.tenant_id, &t.pool_id, volumes, &facts).await?;
    }
    let events = domain::update(before.as_ref(), &p.tenant_id, &p.template_id, spec, &facts)?;
    seal_user_data(ctx, tx, &t.id, version, p.settings.user_data.as_deref()).await?;
    let tenant = Some(p.tenant_id.as_str());
    let after = record_existing(ctx, tx, &p.template_id, before.as_ref(), events, tenant).await?;
    super::activity::follow_template(tx, &p.template_id, ctx.clock.now()).await?;
    Ok(after)
}

/// Replaces a template's labels (`template.labeled`).
pub async fn set_labels(
    ctx: &Ctx,
    tenant_id: &str,
    template_id: &str,
    labels: vps_domain::labels::Labels,
) -> Result<Template, CommandError> {
    transaction(ctx, template_id, async |tx| {
        let before = super::template(tx, template_id).await?;
        let events = domain::set_labels(before.as_ref(), tenant_id, template_id, labels.clone())?;
        record_existing(
            ctx,
            tx,
            template_id,
            before.as_ref(),
            events,
            Some(tenant_id),
        )
        .await
    })
    .await
}

/// Deletes a template: hidden, its name free; the reconciler drains its warm instances.
pub async fn delete(
    ctx: &Ctx,
    tenant_id: &str,
    template_id: &str,
) -> Result<Template, CommandError> {
    transaction(ctx, template_id, async |tx| {
        change_existing::<Template>(ctx, tx, template_id, Some(tenant_id), |t| {
            domain::delete(t, tenant_id, template_id)
        })
        .await
    })
    .await
}

/// A template's `volumes` resolved to the tenant's volumes; none when there are none or the
/// pool does not resolve (the decision then refuses the pool).
async fn mounts(
    tx: &mut PgConnection,
    tenant_id: &str,
    pool_id: &str,
    volumes: &Option<Vec<VolumeMount>>,
    facts: &TemplateFacts,
) -> Result<Vec<TemplateVolume>, CommandError> {
    match volumes {
        Some(mounts) if facts.pool.is_some() => {
            crate::volumes::resolve_mounts(tx, tenant_id, pool_id, mounts).await
        }
        _ => Ok(Vec::new()),
    }
}

async fn seal_user_data(
    ctx: &Ctx,
    tx: &mut PgConnection,
    template_id: &str,
    instance_version: u64,
    user_data: Option<&str>,
) -> Result<(), CommandError> {
    if let Some(data) = user_data {
        let reference = user_data_ref(template_id, instance_version);
        secrets::seal(tx, &ctx.secrets, &reference, template_id, data.as_bytes()).await?;
    }
    Ok(())
}

/// What a template's spec names, as it stands for the tenant.
async fn template_facts(
    tx: &mut PgConnection,
    tenant_id: &str,
    pool_id: &str,
    spec: &TemplateSpec,
    name: &str,
    id: &str,
) -> Result<TemplateFacts, CommandError> {
    let probe = CreateInput {
        tenant_id: tenant_id.to_string(),
        pool_id: pool_id.to_string(),
        flavor: spec.flavor.clone(),
        image_id: spec.image_id.clone(),
        ssh_keys: Vec::new(),
        user_data: None,
        project_id: None,
        desired_state: None,
        idempotency_key: String::new(),
        labels: None,
    };
    let read = facts::create_facts(tx, &probe, facts::PoolReads::NONE).await?;
    let refs: Vec<&str> = spec.env.values().map(String::as_str).collect();
    let name_taken =
        vps_projections::sandboxes::template_name_taken(&mut *tx, tenant_id, name, id).await?;
    Ok(TemplateFacts {
        pool: read.pool,
        flavor_exists: read.shape.is_some(),
        image_exists: read.image.is_some(),
        missing_secrets: secrets::foreign_refs(tx, tenant_id, &refs).await?,
        name_taken,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TemplateSpec {
        TemplateSpec {
            flavor: "small".into(),
            image_id: "img_a".into(),
            user_data_ref: Some("secret://sbxt_a/user-data-1".into()),
            env: BTreeMap::from([("A".into(), "secret://acme/a".into())]),
            network: Network::default(),
            network_rules: Default::default(),
            default_ttl_seconds: 60,
            max_ttl_seconds: 120,
            warm: None,
            volumes: Vec::new(),
            paused_ttl_seconds: 3600,
            on_timeout: Default::default(),
            auto_resume: false,
            idle_timeout_seconds: None,
            idle_cpu_percent: Default::default(),
        }
    }

    #[test]
    fn settings_given_replace_the_spec_and_absent_ones_keep_it() {
        let kept = TemplateSettings::default().applied(spec(), user_data_ref("sbxt_a", 2));
        assert_eq!(kept, spec());
        let given = TemplateSettings {
            user_data: Some("#cloud-config".into()),
            max_ttl_seconds: Some(600),
            warm: Some(Warm { min: 1, max: 2 }),
            ..Default::default()
        };
        let changed = given.applied(spec(), user_data_ref("sbxt_a", 2));
        assert_eq!(
            changed.user_data_ref.as_deref(),
            Some("secret://sbxt_a/user-data-2")
        );
        assert_eq!(changed.max_ttl_seconds, 600);
        assert_eq!(changed.warm, Some(Warm { min: 1, max: 2 }));
        assert_eq!((changed.default_ttl_seconds, changed.env), (60, spec().env));
    }
}
