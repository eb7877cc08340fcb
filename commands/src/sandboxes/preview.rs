//! Preview URLs: `sandboxes.expose` and `sandboxes.unexpose` record an exposure and its
//! revocation on the sandbox's stream; [`open`] mints the tunnel a proxied request goes
//! through. That tunnel is an exec ticket (the same single-use, hashed, node-bound ticket)
//! that also names the guest port, so the host connects the stream to `guest:port` rather
//! than opening an SSH session.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use vps_domain::sandbox::preview as domain;
use vps_domain::state_table::InstanceState;
use vps_domain::DomainError;

use super::exec::tunnel::{self, Binding, Ticket};
use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{record_existing, transaction};

/// Exposes `port` of a ready sandbox of `tenant_id` for `ttl_seconds`; answers when its URL
/// ends (whole seconds).
pub async fn expose(
    ctx: &Ctx,
    tenant_id: &str,
    sandbox_id: &str,
    port: u16,
    ttl_seconds: Option<u64>,
) -> Result<DateTime<Utc>, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let s = super::visible(tx, tenant_id, sandbox_id).await?;
        let (events, expires_at) = domain::expose(&s, port, ttl_seconds, ctx.clock.now())?;
        record_existing(ctx, tx, sandbox_id, Some(&s), events, Some(tenant_id)).await?;
        Ok(expires_at)
    })
    .await
}

/// Revokes `port`'s preview URL; answers whether one was exposed.
pub async fn unexpose(
    ctx: &Ctx,
    tenant_id: &str,
    sandbox_id: &str,
    port: u16,
) -> Result<bool, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let s = super::visible(tx, tenant_id, sandbox_id).await?;
        let events = domain::unexpose(&s, port);
        let revoked = !events.is_empty();
        if revoked {
            record_existing(ctx, tx, sandbox_id, Some(&s), events, Some(tenant_id)).await?;
        }
        Ok(revoked)
    })
    .await
}

/// Where a proxied request goes, and the ticket that opens it once.
#[derive(Debug, Clone)]
pub struct PreviewTunnel {
    /// The node's tunnel endpoint (`tcp://host:port`).
    pub url: String,
    /// The single-use ticket, its first line.
    pub ticket: String,
}

/// A tunnel to `port` of `sandbox_id`'s guest for a token that claims an exposure ending at
/// `expires_at` (unix seconds). `None` when the claim no longer stands (the sandbox is gone or
/// not ready, the exposure revoked, replaced or ended, the instance not running): the proxy
/// answers 404 alike, so a token tells nothing more than that it does not open anything.
pub async fn open(
    ctx: &Ctx,
    tunnel_template: Option<&str>,
    sandbox_id: &str,
    port: u16,
    expires_at: i64,
) -> Result<Option<PreviewTunnel>, CommandError> {
    let mut conn = ctx.pool.acquire().await?;
    open_in(
        ctx,
        &mut conn,
        tunnel_template,
        sandbox_id,
        port,
        expires_at,
    )
    .await
}

async fn open_in(
    ctx: &Ctx,
    conn: &mut PgConnection,
    tunnel_template: Option<&str>,
    sandbox_id: &str,
    port: u16,
    expires_at: i64,
) -> Result<Option<PreviewTunnel>, CommandError> {
    let now = ctx.clock.now();
    let refused = |why: &str| {
        tracing::debug!(sandbox = sandbox_id, port, why, "preview refused");
        Ok(None)
    };
    let Some(s) = vps_projections::sandboxes::load_sandbox(conn, sandbox_id).await? else {
        return refused("no such sandbox");
    };
    if !domain::admits(&s, port, expires_at, now) {
        return refused("not ready, or the exposure is revoked, replaced or ended");
    }
    let Some(instance) = vps_projections::instances::load(conn, &s.instance_id).await? else {
        return refused("no instance");
    };
    let Some(node_id) = instance
        .node_id
        .clone()
        .filter(|_| instance.state == InstanceState::Running)
    else {
        return refused("the instance is not running");
    };
    let url = match tunnel::endpoint(conn, &node_id, tunnel_template).await {
        Ok(url) => url,
        Err(CommandError::Domain(DomainError::Unsupported { .. })) => {
            return refused("the node accepts no tunnels")
        }
        Err(e) => return Err(e),
    };
    let ticket = Ticket::new();
    let valid_before = DateTime::from_timestamp(expires_at, 0).unwrap_or(now);
    let binding = Binding {
        node_id: &node_id,
        instance_id: &instance.id,
        principal: &instance.id,
        valid_before,
        port: Some(port),
    };
    tunnel::store(conn, &ticket, &binding, now).await?;
    // A preview request is a sign of life.
    super::activity::touch(&mut *conn, &instance.id, now).await?;
    Ok(Some(PreviewTunnel {
        url,
        ticket: ticket.text,
    }))
}
