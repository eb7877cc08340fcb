//! The tunnel half of `sandboxes.exec`: where a node accepts tunnels, and the single-use
//! tickets that open one (`nodes.redeemTicket`).
//!
//! A node states its endpoint in its reports (`tunnelUrl`, like a kubelet reporting its daemon
//! port in its status), kept in `node_tunnels`; `[sandbox_exec] tunnel_url` overrides it with a
//! template for deployments whose nodes are reached by name. Tickets are random, live
//! [`TICKET_TTL`], are stored only as a hash, and are bound to one node, instance, principal
//! and certificate end. `exec_tickets` is operational state, not a projection: a redeem is one
//! `DELETE … RETURNING`, so across replicas exactly one redeem of a ticket succeeds.

use chrono::{DateTime, TimeDelta, Utc};
use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use vps_domain::DomainError;

use crate::error::CommandError;

/// How long a ticket may wait for its redeem.
pub const TICKET_TTL: TimeDelta = TimeDelta::seconds(60);

/// What a redeemed ticket was bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redeemed {
    /// The instance the tunnel reaches.
    pub instance_id: String,
    /// The principal the certificate names.
    pub principal: String,
    /// When the certificate ends.
    pub valid_before: DateTime<Utc>,
    /// A preview URL's tunnel: the guest port to connect to instead of its `sshd`.
    pub port: Option<u16>,
}

/// A new ticket: what the caller is given, and what is stored.
pub struct Ticket {
    /// `xt_` and 64 hex digits.
    pub text: String,
    /// Its SHA-256 (hex).
    pub hash: String,
}

impl Ticket {
    /// A fresh random ticket.
    pub fn new() -> Ticket {
        let text = format!(
            "xt_{}",
            data_encoding::HEXLOWER.encode(&rand::random::<[u8; 32]>())
        );
        let hash = hash(&text);
        Ticket { text, hash }
    }
}

impl Default for Ticket {
    fn default() -> Self {
        Ticket::new()
    }
}

fn hash(ticket: &str) -> String {
    data_encoding::HEXLOWER.encode(&Sha256::digest(ticket.as_bytes()))
}

/// `[sandbox_exec] tunnel_url` for one node: `{nodeId}` and `{nodeName}` replaced.
pub fn render(template: &str, node_id: &str, node_name: &str) -> String {
    template
        .replace("{nodeId}", node_id)
        .replace("{nodeName}", node_name)
}

/// Keeps the endpoint a node's report states (a report without one leaves the last one).
pub async fn advertise(
    tx: &mut PgConnection,
    node_id: &str,
    url: &str,
    now: DateTime<Utc>,
) -> Result<(), CommandError> {
    sqlx::query(
        "INSERT INTO node_tunnels (node_id, url, reported_at) VALUES ($1, $2, $3)
         ON CONFLICT (node_id) DO UPDATE SET url = excluded.url, reported_at = excluded.reported_at
          WHERE node_tunnels.url <> excluded.url",
    )
    .bind(node_id)
    .bind(url)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Where `node_id` accepts tunnels: the configured template, or what the node stated.
/// `UNSUPPORTED` when neither says.
pub async fn endpoint(
    tx: &mut PgConnection,
    node_id: &str,
    template: Option<&str>,
) -> Result<String, CommandError> {
    if let Some(template) = template {
        let name = vps_projections::nodes::name(tx, node_id).await?;
        return Ok(render(
            template,
            node_id,
            name.as_deref().unwrap_or(node_id),
        ));
    }
    let stated: Option<String> =
        sqlx::query_scalar("SELECT url FROM node_tunnels WHERE node_id = $1")
            .bind(node_id)
            .fetch_optional(&mut *tx)
            .await?;
    stated.ok_or_else(|| {
        DomainError::unsupported(format!(
            "node {node_id} accepts no tunnels: its host states no tunnelUrl and \
             [sandbox_exec] tunnel_url is not set"
        ))
        .into()
    })
}

/// What a ticket opens.
pub struct Binding<'a> {
    /// The node whose host must redeem it.
    pub node_id: &'a str,
    /// The instance.
    pub instance_id: &'a str,
    /// The certificate's principal.
    pub principal: &'a str,
    /// The certificate's end.
    pub valid_before: DateTime<Utc>,
    /// A preview URL's tunnel: the guest port the host connects it to (no SSH session).
    pub port: Option<u16>,
}

/// Stores `ticket` (its hash) bound to `binding`, valid until `now` + [`TICKET_TTL`], and
/// drops tickets that have expired. Answers the ticket's end.
pub async fn store(
    tx: &mut PgConnection,
    ticket: &Ticket,
    binding: &Binding<'_>,
    now: DateTime<Utc>,
) -> Result<DateTime<Utc>, CommandError> {
    sweep(tx, now).await?;
    let expires_at = now + TICKET_TTL;
    sqlx::query(
        "INSERT INTO exec_tickets (ticket_hash, node_id, instance_id, principal, valid_before,
                                   expires_at, port)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(&ticket.hash)
    .bind(binding.node_id)
    .bind(binding.instance_id)
    .bind(binding.principal)
    .bind(binding.valid_before)
    .bind(expires_at)
    .bind(binding.port.map(i32::from))
    .execute(&mut *tx)
    .await?;
    Ok(expires_at)
}

/// Redeems a ticket for `node_id`, exactly once: an unknown, used, expired or another node's
/// ticket is `NOT_FOUND` (and another node's stays usable by its own node).
pub async fn redeem(
    conn: &mut PgConnection,
    node_id: &str,
    ticket: &str,
    now: DateTime<Utc>,
) -> Result<Redeemed, CommandError> {
    let row: Option<(String, String, DateTime<Utc>, Option<i32>)> = sqlx::query_as(
        "DELETE FROM exec_tickets
          WHERE ticket_hash = $1 AND node_id = $2 AND expires_at > $3
         RETURNING instance_id, principal, valid_before, port",
    )
    .bind(hash(ticket))
    .bind(node_id)
    .bind(now)
    .fetch_optional(&mut *conn)
    .await?;
    sweep(conn, now).await?;
    let (instance_id, principal, valid_before, port) =
        row.ok_or_else(|| DomainError::NotFound {
            what: "ticket".into(),
        })?;
    Ok(Redeemed {
        instance_id,
        principal,
        valid_before,
        port: port.and_then(|p| u16::try_from(p).ok()),
    })
}

/// Drops expired tickets (a handful at most: each lives a minute).
async fn sweep(conn: &mut PgConnection, now: DateTime<Utc>) -> Result<(), CommandError> {
    sqlx::query("DELETE FROM exec_tickets WHERE expires_at <= $1")
        .bind(now)
        .execute(&mut *conn)
        .await?;
    Ok(())
}
