//! `sandboxes.exec`: a short OpenSSH user certificate for the caller's key, signed by the
//! deployment's sandbox CA, and a single-use tunnel ticket for the node that runs the sandbox's
//! instance. One transaction stores the ticket and appends `sandbox.exec.issued` (serial, key
//! id, principal, end; never the certificate), so a ticket exists only for a recorded
//! certificate.
//!
//! - [`ca`], the CA key and the certificates it signs.
//! - [`tunnel`], where nodes accept tunnels and the tickets `nodes.redeemTicket` consumes.

pub mod ca;
pub mod tunnel;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use vps_domain::sandbox::exec::{self as domain, ExecWindow};
use vps_domain::state_table::InstanceState;
use vps_domain::DomainError;

use self::ca::{SandboxCa, UserKey};
use self::tunnel::{Binding, Ticket};
use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{record_events, transaction};

/// What the deployment configures for exec.
#[derive(Debug, Clone, Copy)]
pub struct ExecSettings<'a> {
    /// The sandbox CA.
    pub ca: &'a SandboxCa,
    /// `[sandbox_exec] tunnel_url`: a template (`{nodeId}`, `{nodeName}`) that overrides the
    /// endpoint nodes state.
    pub tunnel_url: Option<&'a str>,
}

/// `sandboxes.exec`, checked at the edge (the key parsed).
#[derive(Debug, Clone)]
pub struct ExecRequest {
    /// The tenant.
    pub tenant_id: String,
    /// `sbx_…`.
    pub sandbox_id: String,
    /// The key to certify.
    pub public_key: UserKey,
    /// The certificate's lifetime (default 300, at most 900).
    pub ttl_seconds: Option<u64>,
}

/// A signed certificate and the ticket that goes with it.
#[derive(Debug, Clone)]
pub struct ExecGrant {
    /// The OpenSSH user certificate (one line).
    pub certificate: String,
    /// Its serial.
    pub serial: u64,
    /// Its key id.
    pub key_id: String,
    /// Its one principal.
    pub principal: String,
    /// When it stops being valid.
    pub valid_before: DateTime<Utc>,
    /// The instance it opens.
    pub instance_id: String,
    /// The node that runs it.
    pub node_id: String,
    /// The instance's first address, if it has one.
    pub address: Option<String>,
    /// Where the node accepts tunnels.
    pub tunnel_url: String,
    /// The single-use ticket.
    pub ticket: String,
    /// When the ticket expires unused.
    pub ticket_expires_at: DateTime<Utc>,
}

/// Signs a certificate for the request's key and issues a ticket for the sandbox's node.
#[tracing::instrument(skip_all, fields(sandbox = %request.sandbox_id))]
pub async fn issue(
    ctx: &Ctx,
    settings: ExecSettings<'_>,
    request: &ExecRequest,
) -> Result<ExecGrant, CommandError> {
    transaction(ctx, &request.sandbox_id, async |tx| {
        issue_in(ctx, tx, settings, request).await
    })
    .await
}

async fn issue_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    settings: ExecSettings<'_>,
    request: &ExecRequest,
) -> Result<ExecGrant, CommandError> {
    let s = super::visible(tx, &request.tenant_id, &request.sandbox_id).await?;
    let instance = vps_projections::instances::load(tx, &s.instance_id).await?;
    // A running, placed instance and its node; `None` lets `window` refuse the sandbox.
    let placed = instance
        .filter(|i| i.state == InstanceState::Running)
        .and_then(|i| i.node_id.clone().map(|node| (i, node)));
    let now = ctx.clock.now();
    let mut window = domain::window(&s, placed.is_some(), request.ttl_seconds, now)?;
    let Some((instance, node_id)) = placed else {
        // `window` refused this already; the refusal is repeated rather than assumed.
        let message = format!(
            "the instance {} of sandbox {} is not running",
            s.instance_id, s.id
        );
        return Err(DomainError::invalid_state(message).into());
    };
    if super::snapshots::shares_identity(tx, &instance).await? {
        return Err(domain::shares_identity_refusal(&s).into());
    }
    // A memory restore's sshd still answers as the instance its memory was captured on.
    if let Some(principal) = instance
        .restore_from
        .as_ref()
        .and_then(|r| r.principal_instance_id.clone())
    {
        window.principal = principal;
    }
    let tunnel_url = tunnel::endpoint(tx, &node_id, settings.tunnel_url).await?;
    let serial = new_serial();
    let key_id = domain::key_id(&s, serial);
    let certificate = settings
        .ca
        .sign(&request.public_key, &window, serial, &key_id)?;
    let ticket = Ticket::new();
    let binding = Binding {
        node_id: &node_id,
        instance_id: &instance.id,
        principal: &window.principal,
        valid_before: window.valid_before,
        port: None,
    };
    let ticket_expires_at = tunnel::store(tx, &ticket, &binding, now).await?;
    let events = domain::issued(&s, serial, &window);
    record_events(ctx, tx, &s.id, Some(&s), events, Some(&s.tenant_id)).await?;
    // An exec session is a sign of life (after the sandbox's row: the lock order).
    super::activity::touch(&mut *tx, &instance.id, now).await?;
    let ExecWindow {
        principal,
        valid_before,
        ..
    } = window;
    Ok(ExecGrant {
        certificate,
        serial,
        key_id,
        principal,
        valid_before,
        instance_id: instance.id.clone(),
        node_id,
        address: instance.addresses.first().cloned(),
        tunnel_url,
        ticket: ticket.text,
        ticket_expires_at,
    })
}

/// A random certificate serial below 2^53, so it survives every JSON reader exactly.
fn new_serial() -> u64 {
    rand::random::<u64>() % ((1 << 53) - 1) + 1
}
