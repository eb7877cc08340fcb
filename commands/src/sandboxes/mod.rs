//! Sandboxes and their templates (SPEC §3.8). A sandbox drives one ordinary hosted instance:
//! a warm one claimed from its template's pool, or one admitted exactly like
//! `instances.create`. Every sandbox change is an event on its own stream; the instance's
//! changes stay the instance aggregate's.
//!
//! - [`templates`], the `sandboxTemplates` methods.
//! - [`create`], `sandboxes.create` (claim or cold create, in one transaction).
//! - [`exec`], `sandboxes.exec` (a short certificate and a tunnel ticket) and `nodes.redeemTicket`.
//! - [`fork`], the record of `sandboxes.fork` (a memory snapshot restored `count` times).
//! - [`lifecycle`], extend, delete, and the reconciler's expiry and fallbacks.
//! - [`follow`], the sandbox's side of an instance change (ready, failed, deleted), recorded
//!   in the instance change's own transaction.
//! - [`template_instance`], what every instance of a template is admitted with.
//! - [`snapshots`], taking, settling, deleting and purging snapshots, and what a restore
//!   boots from.
//! - [`preview`], `sandboxes.expose` and `sandboxes.unexpose`, and the tunnel a preview URL's
//!   request goes through.
//! - [`warm`], claiming a warm instance, and the warm pools' refill and drain.
//! - [`activity`], idle pause's data: CPU samples and signs of life, beside the log.

pub mod activity;
pub mod create;
pub mod exec;
pub mod follow;
pub mod fork;
pub mod lifecycle;
pub mod preview;
pub mod snapshots;
pub mod template_instance;
pub mod templates;
pub mod warm;

use sqlx::PgConnection;
use vps_domain::sandbox::Sandbox;
use vps_domain::template::Template;
use vps_domain::DomainError;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::load;

/// What a decision on an existing sandbox (extend, exec) reads before anything is written:
/// the sandbox, its template's `maxTtlSeconds` (0 when the template is gone) and its
/// instance's shape.
pub async fn decision_facts(
    ctx: &Ctx,
    tenant_id: &str,
    sandbox_id: &str,
) -> Result<(Sandbox, u64, Option<vps_domain::resources::Shape>), CommandError> {
    let mut conn = ctx.pool.acquire().await?;
    let s = visible(&mut conn, tenant_id, sandbox_id).await?;
    // A template deleted since still bounds its sandboxes' lifetime.
    let max_ttl = template(&mut conn, &s.template_id)
        .await?
        .map_or(0, |t| t.spec.max_ttl_seconds);
    let shape = vps_projections::instances::load(&mut conn, &s.instance_id)
        .await?
        .map(|i| i.shape);
    Ok((s, max_ttl, shape))
}

/// A sandbox the tenant may see: another tenant's is `NOT_FOUND`.
pub async fn visible(
    tx: &mut PgConnection,
    tenant_id: &str,
    sandbox_id: &str,
) -> Result<Sandbox, CommandError> {
    match load::<Sandbox>(tx, sandbox_id).await? {
        Some(s) if s.tenant_id == tenant_id => Ok(s),
        _ => Err(DomainError::NotFound {
            what: format!("sandbox {sandbox_id}"),
        }
        .into()),
    }
}

/// A template as stored (deleted ones too), from its stream.
pub async fn template(tx: &mut PgConnection, id: &str) -> Result<Option<Template>, CommandError> {
    load::<Template>(tx, id).await
}
