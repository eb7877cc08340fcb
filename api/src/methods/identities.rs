//! `identities.*` and `apiKeys.revoke`: identities an operator creates at run time, besides
//! the `[[identities]]` of the configuration (the bootstrap), and their API keys.
//!
//! `apiKeys.revoke` on one's own identity is "sign out", on purpose: any run-time key may
//! revoke its own identity's keys (the answer says `signedOut: true`, and the key is refused
//! from the commit on). Operators revoke any run-time identity's keys; a tenant's key names
//! only its own identity (any other is `NOT_FOUND`, as if it did not exist).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vps_commands::identities::{self as commands, NewIdentity};
use vps_domain::ErrorCode;

use crate::config::IdentityConfig;

use crate::error::ApiError;
use crate::registry::{Access::Operator, Access::Tenant, Call, Items, Method, NoParams};

/// `apiKeys.revoke`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RevokeKeys {
    /// The identity whose keys are revoked.
    identity_id: String,
}

/// An identity.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IdentityAnswer {
    /// `id_…`.
    id: String,
    /// The tenant it acts for.
    tenant_id: Option<String>,
    /// Operators may do everything.
    operator: bool,
    /// For people.
    name: String,
}

/// A new identity and its API key (shown this once).
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Created {
    /// The identity.
    identity: IdentityAnswer,
    /// `vpk_…`: the bearer token.
    api_key: String,
}

/// What `apiKeys.revoke` did.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Revoked {
    /// The identity.
    identity_id: String,
    /// How many keys were revoked.
    revoked: usize,
    /// The caller revoked its own identity's keys: its key no longer works.
    signed_out: bool,
}

/// Where an identity comes from.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    /// `[[identities]]` of the configuration: its token changes only there.
    Config,
    /// `identities.create`.
    Api,
}

/// An identity as `identities.list` answers it.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListedIdentity {
    /// `id_…`.
    id: String,
    /// The tenant it acts for.
    tenant_id: Option<String>,
    /// Operators may do everything.
    operator: bool,
    /// For people (a configured identity's is its id).
    name: String,
    /// Bearer credentials in force: API keys not revoked, or 1 for a configured token.
    keys: i32,
    /// When it was created (none for a configured one).
    created_at: Option<DateTime<Utc>>,
    /// Where it comes from.
    source: Source,
}

impl From<&IdentityConfig> for ListedIdentity {
    fn from(c: &IdentityConfig) -> Self {
        ListedIdentity {
            id: c.identity.clone(),
            tenant_id: c.tenant.clone(),
            operator: c.operator,
            name: c.identity.clone(),
            keys: 1,
            created_at: None,
            source: Source::Config,
        }
    }
}

/// The methods of the groups.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "identities",
            "create",
            Operator,
            "Creates an identity; answers its API key once.",
            create,
        ),
        Method::new(
            "identities",
            "list",
            Operator,
            "Every identity: the configuration's, then those created at run time.",
            list,
        ),
        Method::new(
            "apiKeys",
            "revoke",
            Tenant,
            "Revokes every API key of an identity: operators any, a key its own (sign out).",
            revoke,
        ),
    ]
}

async fn create(c: Call, q: NewIdentity) -> Result<Created, ApiError> {
    let (identity, key) = commands::create(&c.ctx, q).await?;
    Ok(Created {
        identity: IdentityAnswer {
            id: identity.id,
            tenant_id: identity.tenant_id,
            operator: identity.operator,
            name: identity.name,
        },
        api_key: key.0,
    })
}

async fn list(c: Call, _: NoParams) -> Result<Items<ListedIdentity>, ApiError> {
    let configured = c.config.identities.iter().map(ListedIdentity::from);
    let created = vps_projections::identities::list(&c.ctx.pool).await?;
    let created = created.into_iter().map(|i| ListedIdentity {
        id: i.id,
        tenant_id: i.tenant_id,
        operator: i.operator,
        name: i.name,
        keys: i.keys,
        created_at: Some(i.created_at),
        source: Source::Api,
    });
    Ok(configured.chain(created).collect::<Vec<_>>().into())
}

async fn revoke(c: Call, q: RevokeKeys) -> Result<Revoked, ApiError> {
    let own = q.identity_id == c.caller.actor.identity;
    if !c.caller.actor.operator && !own {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!("identity {} not found", q.identity_id),
        ));
    }
    if c.config
        .identities
        .iter()
        .any(|i| i.identity == q.identity_id)
    {
        return Err(ApiError::new(
            ErrorCode::InvalidState,
            format!(
                "{} is a configured identity: its token is changed in [[identities]], not revoked",
                q.identity_id
            ),
        ));
    }
    let revoked = commands::revoke_keys(&c.ctx, &q.identity_id).await?;
    Ok(Revoked {
        identity_id: q.identity_id,
        revoked,
        signed_out: own,
    })
}
