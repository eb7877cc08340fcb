//! `sandboxTemplates.*`, `sandboxes.*` and `secrets.put` (the tenant secrets a template's
//! `env` names). Another tenant's template or sandbox is `NOT_FOUND`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vps_commands::sandboxes::create::CreateSandboxInput;
use vps_commands::sandboxes::templates::{TemplateInput, TemplatePatch};
use vps_commands::sandboxes::{self, lifecycle};
use vps_domain::authz::Resource;
use vps_domain::sandbox::{extended_expiry, parse_duration, Extension, Sandbox, SandboxState};
use vps_projections::sandboxes::SandboxFilter;
use vps_projections::views::{SandboxView, TemplateView};

use crate::error::ApiError;
use crate::methods::common::{label_filter, Wait};
use crate::registry::{Access::Tenant, Call, Items, Method};
use vps_domain::ids::{SandboxId, TemplateId};

/// A template by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateRef {
    /// The tenant.
    tenant_id: String,
    /// `sbxt_…`.
    template_id: TemplateId,
}

/// `sandboxes.create`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateBody {
    #[serde(flatten)]
    input: CreateSandboxInput,
    /// Answer once the sandbox leaves `starting`, or after the timeout.
    wait: Option<Wait>,
}

/// A sandbox by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxRef {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`.
    sandbox_id: SandboxId,
}

/// `sandboxes.delete`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeleteBody {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`.
    sandbox_id: String,
    /// Delete at once without waiting for the host: its instance is released now, and a host
    /// that still holds it is told to let it go.
    force: Option<bool>,
}

/// `sandboxes.setLabels`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetSandboxLabels {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`.
    sandbox_id: SandboxId,
    /// The labels (they replace the sandbox's): at most 32, Kubernetes label syntax.
    labels: vps_domain::labels::Labels,
}

/// `sandboxTemplates.setLabels`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetTemplateLabels {
    /// The tenant.
    tenant_id: String,
    /// `sbxt_…`.
    template_id: TemplateId,
    /// The labels (they replace the template's): at most 32, Kubernetes label syntax.
    labels: vps_domain::labels::Labels,
}

/// `sandboxTemplates.list`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListTemplatesBody {
    /// The tenant.
    tenant_id: String,
    /// Only templates carrying every one of these labels (at most 32 pairs).
    labels: Option<vps_domain::labels::Labels>,
}

/// `sandboxes.resume`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResumeBody {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`.
    sandbox_id: SandboxId,
    /// The fresh lifetime: 1 to the template's `maxTtlSeconds` (default: its
    /// `defaultTtlSeconds`).
    ttl_seconds: Option<u64>,
}

/// `by`: `"30m"`, `"8h"`, `"7d"`, or milliseconds.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum By {
    /// Milliseconds.
    Millis(i64),
    /// A duration like `30m`.
    Text(String),
}

/// `sandboxes.extend`: exactly one of `until` or `by`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtendBody {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`.
    sandbox_id: SandboxId,
    /// The new expiry (RFC 3339).
    until: Option<DateTime<Utc>>,
    /// Added to the current expiry (at most 30 days).
    by: Option<By>,
}

/// `sandboxes.list`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListBody {
    /// The tenant.
    tenant_id: String,
    /// `mine` (default) or `all`.
    scope: Option<String>,
    /// Deleted ones too.
    deleted: Option<bool>,
    /// Only this template's.
    template_id: Option<TemplateId>,
    /// Only sandboxes carrying every one of these labels (at most 32 pairs).
    labels: Option<vps_domain::labels::Labels>,
    /// 1 to 200 (default 50).
    limit: Option<i64>,
    /// The previous page's cursor (opaque).
    cursor: Option<String>,
}

/// A page of sandboxes, newest first.
#[derive(Serialize, schemars::JsonSchema)]
pub struct SandboxPage {
    /// The sandboxes.
    items: Vec<SandboxView>,
    /// Present when there are more.
    cursor: Option<String>,
}

/// `secrets.put`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PutSecretBody {
    /// The tenant.
    tenant_id: String,
    /// 1 to 63 letters, digits, `-`, `_` or `.`.
    name: String,
    /// The value (at most 64 KiB); never shown again.
    value: String,
}

/// A tenant secret's reference.
#[derive(Serialize, schemars::JsonSchema)]
pub struct SecretRef {
    /// The name.
    name: String,
    /// `secret://<tenant>/<name>`, for a template's `env`.
    #[serde(rename = "ref")]
    reference: String,
}

/// The methods of the groups.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "sandboxTemplates",
            "create",
            Tenant,
            "Creates a sandbox template.",
            create_template,
        ),
        Method::new(
            "sandboxTemplates",
            "get",
            Tenant,
            "One live template.",
            get_template,
        ),
        Method::new(
            "sandboxTemplates",
            "list",
            Tenant,
            "The tenant's live templates, by name.",
            list_templates,
        ),
        Method::new(
            "sandboxTemplates",
            "update",
            Tenant,
            "Changes a template (its version rises).",
            update_template,
        ),
        Method::new(
            "sandboxTemplates",
            "setLabels",
            Tenant,
            "Replaces a template's labels.",
            set_template_labels,
        ),
        Method::new(
            "sandboxTemplates",
            "delete",
            Tenant,
            "Hides a template and frees its name.",
            delete_template,
        ),
        Method::new(
            "sandboxes",
            "create",
            Tenant,
            "Creates a sandbox: a warm claim, or a cold create.",
            create,
        ),
        Method::new("sandboxes", "get", Tenant, "One sandbox.", get),
        Method::new(
            "sandboxes",
            "list",
            Tenant,
            "The tenant's sandboxes, newest first.",
            list,
        ),
        Method::new(
            "sandboxes",
            "extend",
            Tenant,
            "Moves a sandbox's expiry later.",
            extend,
        ),
        Method::new(
            "sandboxes",
            "delete",
            Tenant,
            "Deletes a sandbox and its instance (`force`: at once, without waiting for the host).",
            delete,
        ),
        Method::new(
            "sandboxes",
            "setLabels",
            Tenant,
            "Replaces a sandbox's labels.",
            set_labels,
        ),
        Method::new(
            "sandboxes",
            "pause",
            Tenant,
            "Pauses a sandbox (memory kept, lifetime clock stopped).",
            pause,
        ),
        Method::new(
            "sandboxes",
            "resume",
            Tenant,
            "Resumes a paused sandbox with a fresh lifetime.",
            resume,
        ),
        Method::new(
            "secrets",
            "put",
            Tenant,
            "Stores a tenant secret for templates' env.",
            put_secret,
        ),
    ]
}

async fn create_template(c: Call, mut q: TemplateInput) -> Result<TemplateView, ApiError> {
    q.tenant_id = c.caller.tenant(&q.tenant_id)?;
    let max = c.config.limits.templates_per_tenant;
    let t = sandboxes::templates::create_bounded(&c.ctx, q, max).await?;
    vps_reactors::sandboxes::wake(&c.ctx);
    Ok(TemplateView::from(&t))
}

async fn get_template(c: Call, q: TemplateRef) -> Result<TemplateView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let mut conn = c.ctx.pool.acquire().await?;
    let stored = sandboxes::template(&mut conn, &q.template_id).await?;
    let t = vps_domain::template::live(stored.as_ref(), &tenant, &q.template_id)
        .map_err(vps_commands::CommandError::from)?;
    Ok(TemplateView::from(t))
}

async fn list_templates(c: Call, q: ListTemplatesBody) -> Result<Items<TemplateView>, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let filter = label_filter(q.labels)?;
    let mut conn = c.ctx.pool.acquire().await?;
    let templates = vps_projections::sandboxes::templates_of(&mut conn, &tenant)
        .await
        .map_err(vps_commands::CommandError::from)?;
    Ok(templates
        .iter()
        .filter(|t| vps_domain::labels::matches(&t.labels, &filter))
        .map(TemplateView::from)
        .collect::<Vec<_>>()
        .into())
}

async fn update_template(c: Call, mut q: TemplatePatch) -> Result<TemplateView, ApiError> {
    q.tenant_id = c.caller.tenant(&q.tenant_id)?;
    let t = sandboxes::templates::update(&c.ctx, q).await?;
    vps_reactors::sandboxes::wake(&c.ctx);
    Ok(TemplateView::from(&t))
}

async fn set_template_labels(c: Call, q: SetTemplateLabels) -> Result<TemplateView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let t = sandboxes::templates::set_labels(&c.ctx, &tenant, &q.template_id, q.labels).await?;
    Ok(TemplateView::from(&t))
}

async fn set_labels(c: Call, q: SetSandboxLabels) -> Result<SandboxView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let s = lifecycle::set_labels(&c.ctx, &tenant, &q.sandbox_id, q.labels).await?;
    Ok(SandboxView::from(&s))
}

async fn delete_template(c: Call, q: TemplateRef) -> Result<TemplateView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let t = sandboxes::templates::delete(&c.ctx, &tenant, &q.template_id).await?;
    vps_reactors::sandboxes::wake(&c.ctx);
    Ok(TemplateView::from(&t))
}

async fn create(c: Call, mut q: CreateBody) -> Result<SandboxView, ApiError> {
    q.input.tenant_id = c.caller.tenant(&q.input.tenant_id)?;
    let wait = q.wait.as_ref().map_or(Ok(Duration::ZERO), Wait::duration)?;
    // Decided inside the create's transaction, on the template and flavor it reads.
    let tenant = q.input.tenant_id.clone();
    let policy = |id: &str, draft: &vps_domain::authz::SandboxDraft| {
        c.guard.refusal(
            &c.guard.action,
            &Resource::sandbox_draft(id, &tenant, draft),
        )
    };
    let created = sandboxes::create::create(&c.ctx, q.input, &policy).await?;
    if created.new && created.sandbox.warm {
        vps_reactors::sandboxes::claimed(&c.ctx);
    }
    let id = created.sandbox.id.clone();
    let settled = |s: &Sandbox| s.state != SandboxState::Starting;
    let load = vps_projections::sandboxes::load_sandbox;
    let row = (crate::wait::Table::Sandboxes, id.as_str());
    let sandbox = crate::wait::settled(
        &c.ctx,
        (&c.guards, &c.watched),
        wait,
        created.sandbox,
        row,
        settled,
        load,
    )
    .await?;
    Ok(SandboxView::from(&sandbox))
}

async fn get(c: Call, q: SandboxRef) -> Result<SandboxView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let mut conn = c.ctx.pool.acquire().await?;
    let mut sandbox = visible(&mut conn, &tenant, &q.sandbox_id).await?;
    // Its snapshots live in their own projection, not in the sandbox's document.
    let snapshots = vps_projections::sandboxes::snapshots_of(&mut conn, &sandbox.id)
        .await
        .map_err(vps_commands::CommandError::from)?;
    sandbox.snapshots = snapshots.into_iter().map(|s| (s.id.clone(), s)).collect();
    Ok(SandboxView::with_snapshots(&sandbox))
}

/// The stored sandbox the tenant may see.
async fn visible(
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    id: &str,
) -> Result<Sandbox, ApiError> {
    vps_projections::sandboxes::load_sandbox(conn, id)
        .await
        .map_err(vps_commands::CommandError::from)?
        .filter(|s| s.tenant_id == tenant)
        .ok_or_else(|| crate::methods::missing("sandbox", id))
}

async fn list(c: Call, q: ListBody) -> Result<SandboxPage, ApiError> {
    let tenant_id = c.caller.tenant(&q.tenant_id)?;
    let limit = super::page_limit(q.limit)?;
    let owner = super::scope_owner(&c, q.scope.as_deref(), super::Scope::Mine)?;
    let filter = SandboxFilter {
        owner,
        deleted: q.deleted.unwrap_or(false),
        template_id: q.template_id.map(String::from),
        labels: label_filter(q.labels)?,
        limit: limit + 1,
        cursor: q
            .cursor
            .as_deref()
            .map(|cursor| super::open_cursor(&c, "sandboxes", &tenant_id, cursor))
            .transpose()?,
        tenant_id,
    };
    let mut conn = c.ctx.pool.acquire().await?;
    let items = vps_projections::sandboxes::page(&mut conn, &filter)
        .await
        .map_err(vps_commands::CommandError::from)?;
    let (items, cursor) = super::split_page(items, limit, |s| {
        super::sign_cursor(&c, "sandboxes", &filter.tenant_id, &s.id)
    });
    Ok(SandboxPage {
        items: items.iter().map(SandboxView::from).collect(),
        cursor,
    })
}

async fn extend(c: Call, q: ExtendBody) -> Result<SandboxView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let extension = match (q.until, q.by) {
        (Some(until), None) => Extension::Until(until),
        (None, Some(By::Millis(ms))) => Extension::By(
            chrono::TimeDelta::try_milliseconds(ms)
                .ok_or_else(|| ApiError::invalid("by", "out of range"))?,
        ),
        (None, Some(By::Text(text))) => {
            Extension::By(parse_duration(&text).map_err(|m| ApiError::invalid("by", m))?)
        }
        _ => {
            return Err(ApiError::invalid(
                "until",
                "give exactly one of until or by",
            ))
        }
    };
    // Decided on the whole lifetime after the change, so a cap on `ttlSeconds` cannot be
    // passed in small steps; the absolute expiry decided on is what gets applied.
    let (s, max_ttl, shape) = sandboxes::decision_facts(&c.ctx, &tenant, &q.sandbox_id).await?;
    let until =
        extended_expiry(&s, extension, max_ttl).map_err(vps_commands::CommandError::from)?;
    let Some(until) = until else {
        return Ok(SandboxView::from(&s));
    };
    let draft = s.draft(shape.as_ref(), (until - s.created_at).num_seconds());
    c.authorize(&Resource::sandbox_draft(&s.id, &tenant, &draft))?;
    let s = lifecycle::extend(&c.ctx, &tenant, &q.sandbox_id, Extension::Until(until)).await?;
    Ok(SandboxView::from(&s))
}

async fn delete(c: Call, q: DeleteBody) -> Result<SandboxView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let s = match q.force {
        Some(true) => lifecycle::force_delete(&c.ctx, &tenant, &q.sandbox_id).await?,
        _ => lifecycle::delete(&c.ctx, &tenant, &q.sandbox_id).await?,
    };
    vps_reactors::sandboxes::wake(&c.ctx);
    Ok(SandboxView::from(&s))
}

async fn pause(c: Call, q: SandboxRef) -> Result<SandboxView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let s = lifecycle::pause(&c.ctx, &tenant, &q.sandbox_id).await?;
    vps_reactors::sandboxes::wake(&c.ctx);
    Ok(SandboxView::from(&s))
}

async fn resume(c: Call, q: ResumeBody) -> Result<SandboxView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    // Decided on the fresh lifetime, as an extend is: a cap on `ttlSeconds` holds here too.
    let (s, _, shape) = sandboxes::decision_facts(&c.ctx, &tenant, &q.sandbox_id).await?;
    let ttl = q.ttl_seconds.map_or(s.lifetime().num_seconds(), |t| {
        i64::try_from(t).unwrap_or(i64::MAX)
    });
    let draft = s.draft(shape.as_ref(), ttl);
    c.authorize(&Resource::sandbox_draft(&s.id, &tenant, &draft))?;
    let s = lifecycle::resume(&c.ctx, &tenant, &q.sandbox_id, q.ttl_seconds).await?;
    vps_reactors::sandboxes::wake(&c.ctx);
    Ok(SandboxView::from(&s))
}

/// Before `call` (exec, snapshot) on a sandbox: a pausing or paused one is `INVALID_STATE`
/// (`details.state`) unless its template sets `autoResume`; then it is resumed first and
/// waited for, up to `wait`. Anything else (another tenant's, a missing one) is left to the
/// call itself.
pub(crate) async fn unpaused(
    c: &Call,
    tenant: &str,
    sandbox_id: &str,
    call: &str,
    wait: Duration,
) -> Result<(), ApiError> {
    let mut conn = c.ctx.pool.acquire().await?;
    let Ok(s) = visible(&mut conn, tenant, sandbox_id).await else {
        return Ok(());
    };
    if !(s.state.is_paused() || s.state == SandboxState::Resuming) {
        return Ok(());
    }
    let auto = sandboxes::template(&mut conn, &s.template_id)
        .await?
        .is_some_and(|t| t.spec.auto_resume);
    drop(conn);
    if !auto {
        return match s.state {
            SandboxState::Resuming => Ok(()),
            _ => Err(
                vps_commands::CommandError::from(vps_domain::sandbox::paused_refusal(&s, call))
                    .into(),
            ),
        };
    }
    let resumed = lifecycle::resume(&c.ctx, tenant, sandbox_id, None).await?;
    let settled = |s: &Sandbox| s.state != SandboxState::Resuming;
    let load = vps_projections::sandboxes::load_sandbox;
    let row = (crate::wait::Table::Sandboxes, sandbox_id);
    let s = crate::wait::settled(
        &c.ctx,
        (&c.guards, &c.watched),
        wait,
        resumed,
        row,
        settled,
        load,
    )
    .await?;
    if s.state != SandboxState::Ready {
        return Err(
            vps_commands::CommandError::from(vps_domain::DomainError::InvalidState {
                message: format!(
                "sandbox {sandbox_id} is {} after waiting for its resume; call again (or with a \
                 longer wait.timeoutMs)",
                s.state
            ),
                details: serde_json::json!({ "state": s.state.as_str(), "sandboxId": sandbox_id }),
            })
            .into(),
        );
    }
    Ok(())
}

async fn put_secret(c: Call, q: PutSecretBody) -> Result<SecretRef, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    vps_domain::operator::check_name("name", &q.name).map_err(vps_commands::CommandError::from)?;
    if q.value.len() > 65_536 {
        return Err(ApiError::invalid("value", "at most 64 KiB"));
    }
    let mut conn = c.ctx.pool.acquire().await?;
    let reference = vps_commands::secrets::put_tenant(
        &mut conn,
        &c.ctx.secrets,
        &tenant,
        &q.name,
        q.value.as_bytes(),
    )
    .await
    .map_err(vps_commands::CommandError::from)?;
    Ok(SecretRef {
        name: q.name,
        reference,
    })
}
