//! `sandboxes.expose` and `sandboxes.unexpose`: preview URLs to a port of a sandbox's guest
//! (the proxy itself is [`crate::preview`]).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vps_commands::sandboxes::preview;
use vps_domain::authz::Resource;
use vps_domain::ids::SandboxId;

use crate::error::ApiError;
use crate::registry::{Access, Call, Method};

/// `sandboxes.expose`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExposeBody {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`.
    sandbox_id: SandboxId,
    /// The guest's TCP port: 1 to 65535.
    port: u64,
    /// How long the URL answers: 1 to the sandbox's remaining lifetime (default 3600, or
    /// the remaining lifetime when shorter).
    ttl_seconds: Option<u64>,
}

/// `sandboxes.unexpose`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UnexposeBody {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`.
    sandbox_id: SandboxId,
    /// The guest's TCP port whose preview URL is revoked.
    port: u64,
}

/// A preview URL.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Exposure {
    /// The sandbox.
    sandbox_id: String,
    /// The guest's port.
    port: u16,
    /// The URL: HTTP/1.1 (WebSocket included) to the guest's port, no other credential
    /// needed. Anyone who holds it reaches the port until it ends or is revoked.
    url: String,
    /// When the URL stops answering (404 after).
    expires_at: DateTime<Utc>,
}

/// What `sandboxes.unexpose` did.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Unexposed {
    /// The sandbox.
    sandbox_id: String,
    /// The guest's port.
    port: u16,
    /// Whether a preview URL was revoked (false: the port was not exposed).
    revoked: bool,
}

/// The methods.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "sandboxes",
            "expose",
            Access::Tenant,
            "A preview URL to a port of a ready sandbox's guest (HTTP/1.1 and WebSocket).",
            expose,
        ),
        Method::new(
            "sandboxes",
            "unexpose",
            Access::Tenant,
            "Revokes a port's preview URL.",
            unexpose,
        ),
    ]
}

async fn expose(c: Call, q: ExposeBody) -> Result<Exposure, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let port =
        vps_domain::sandbox::preview::port(q.port).map_err(vps_commands::CommandError::from)?;
    authorize(&c, &tenant, &q.sandbox_id).await?;
    let expires_at = preview::expose(&c.ctx, &tenant, &q.sandbox_id, port, q.ttl_seconds).await?;
    let claim = crate::preview::Claim {
        sandbox_id: q.sandbox_id.to_string(),
        port,
        expires_at: expires_at.timestamp(),
    };
    let base = c.preview_url.clone();
    Ok(Exposure {
        sandbox_id: claim.sandbox_id.clone(),
        port,
        url: crate::preview::url(&base, &c.ctx.secrets, &claim),
        expires_at,
    })
}

async fn unexpose(c: Call, q: UnexposeBody) -> Result<Unexposed, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let port =
        vps_domain::sandbox::preview::port(q.port).map_err(vps_commands::CommandError::from)?;
    authorize(&c, &tenant, &q.sandbox_id).await?;
    let revoked = preview::unexpose(&c.ctx, &tenant, &q.sandbox_id, port).await?;
    Ok(Unexposed {
        sandbox_id: q.sandbox_id.to_string(),
        port,
        revoked,
    })
}

/// Cedar decides on the sandbox as it is (another tenant's is `NOT_FOUND` first).
async fn authorize(c: &Call, tenant: &str, sandbox_id: &str) -> Result<(), ApiError> {
    let (s, _, shape) = vps_commands::sandboxes::decision_facts(&c.ctx, tenant, sandbox_id).await?;
    let draft = s.draft(shape.as_ref(), s.lifetime().num_seconds());
    c.authorize(&Resource::sandbox_draft(&s.id, tenant, &draft))
}
