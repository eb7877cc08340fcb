//! `sandboxes.exec` (a short OpenSSH certificate and a tunnel ticket into a sandbox) and its
//! host half, `nodes.redeemTicket`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vps_commands::sandboxes::exec::ca::UserKey;
use vps_commands::sandboxes::exec::{self, tunnel, ExecRequest, ExecSettings};
use vps_domain::authz::Resource;
use vps_domain::sandbox::exec::SANDBOX_ACCOUNT;
use vps_domain::ErrorCode;

use crate::error::ApiError;
use crate::registry::{Access, Call, Method};
use vps_domain::ids::{NodeId, SandboxId};

/// `sandboxes.exec`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExecBody {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`.
    sandbox_id: SandboxId,
    /// Your OpenSSH public key line (ssh-ed25519 or ECDSA; RSA is refused).
    public_key: String,
    /// The certificate's lifetime: 1 to 900 seconds (default 300), never past the sandbox's
    /// expiry.
    ttl_seconds: Option<u64>,
    /// With a template's `autoResume`: how long to wait for a paused sandbox to resume.
    wait: Option<crate::methods::common::Wait>,
}

/// Where to open the tunnel, and the ticket that opens it once.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelGrant {
    /// The node's tunnel endpoint (`tcp://host:port`): connect, send the ticket and a newline,
    /// then speak SSH (`vps tunnel --ticket-file …` as OpenSSH's ProxyCommand does it).
    url: String,
    /// Single use.
    ticket: String,
    /// When the ticket expires unused (60 s).
    expires_at: DateTime<Utc>,
}

/// A certificate for your key and a tunnel to the sandbox's instance.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExecAnswer {
    /// The sandbox.
    sandbox_id: String,
    /// The OpenSSH user certificate: save it beside your key as `<key>-cert.pub`.
    certificate: String,
    /// The certificate's one principal: the instance.
    principal: String,
    /// When the certificate ends.
    valid_before: DateTime<Utc>,
    /// The CA that signed it.
    ca_public_key: String,
    /// The tunnel.
    tunnel: TunnelGrant,
    /// The instance the tunnel reaches.
    instance_id: String,
    /// The instance's address, if it has one.
    address: Option<String>,
    /// The account to log in as.
    account: String,
    /// The certificate's key id (`vps:<tenant>:<sandbox>:<serial>`).
    key_id: String,
    /// The certificate's serial.
    serial: u64,
}

/// `nodes.redeemTicket`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RedeemBody {
    /// `node_…`: the node the ticket was issued for.
    node_id: NodeId,
    /// The ticket a client sent.
    ticket: String,
}

/// What a redeemed ticket opens.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Redeemed {
    /// The instance to connect the client to.
    instance_id: String,
    /// The principal the client's certificate must name.
    principal: String,
    /// When the certificate ends.
    valid_before: DateTime<Utc>,
    /// The CA the client's certificate must be signed by.
    ca_public_key: Option<String>,
    /// A preview URL's tunnel: the guest port to connect the stream to (plain TCP, no SSH
    /// session). Absent: an exec tunnel to the guest's `sshd`.
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
}

/// The methods.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "sandboxes",
            "exec",
            Access::Tenant,
            "A short OpenSSH certificate for your key and a tunnel ticket into a sandbox.",
            exec,
        ),
        Method::new(
            "nodes",
            "redeemTicket",
            Access::Node,
            "Redeems a sandbox exec tunnel ticket, exactly once.",
            redeem,
        ),
    ]
}

async fn exec(c: Call, q: ExecBody) -> Result<ExecAnswer, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let Some(ca) = c.sandbox_ca.clone() else {
        return Err(ApiError::new(
            ErrorCode::Unsupported,
            "sandboxes.exec needs a sandbox CA ([sandbox_exec] ca_key)",
        ));
    };
    let public_key = UserKey::parse(&q.public_key).map_err(vps_commands::CommandError::from)?;
    let wait = q
        .wait
        .as_ref()
        .map_or(Ok(std::time::Duration::ZERO), |w| w.duration())?;
    super::sandboxes::unpaused(&c, &tenant, &q.sandbox_id, "exec", wait).await?;
    let (s, _, shape) =
        vps_commands::sandboxes::decision_facts(&c.ctx, &tenant, &q.sandbox_id).await?;
    let draft = s.draft(shape.as_ref(), s.lifetime().num_seconds());
    c.authorize(&Resource::sandbox_draft(&s.id, &tenant, &draft))?;
    let settings = ExecSettings {
        ca: &ca,
        tunnel_url: c.config.sandbox_exec.tunnel_url.as_deref(),
    };
    let request = ExecRequest {
        tenant_id: tenant,
        sandbox_id: q.sandbox_id.into(),
        public_key,
        ttl_seconds: q.ttl_seconds,
    };
    let grant = exec::issue(&c.ctx, settings, &request).await?;
    Ok(ExecAnswer {
        sandbox_id: request.sandbox_id,
        certificate: grant.certificate,
        principal: grant.principal,
        valid_before: grant.valid_before,
        ca_public_key: ca.public_key().to_string(),
        tunnel: TunnelGrant {
            url: grant.tunnel_url,
            ticket: grant.ticket,
            expires_at: grant.ticket_expires_at,
        },
        instance_id: grant.instance_id,
        address: grant.address,
        account: SANDBOX_ACCOUNT.to_string(),
        key_id: grant.key_id,
        serial: grant.serial,
    })
}

async fn redeem(c: Call, q: RedeemBody) -> Result<Redeemed, ApiError> {
    let mut conn = c.ctx.pool.acquire().await?;
    let redeemed = tunnel::redeem(&mut conn, &q.node_id, &q.ticket, c.ctx.clock.now()).await?;
    Ok(Redeemed {
        instance_id: redeemed.instance_id,
        principal: redeemed.principal,
        valid_before: redeemed.valid_before,
        ca_public_key: c.sandbox_ca.as_ref().map(|ca| ca.public_key().to_string()),
        port: redeemed.port,
    })
}
