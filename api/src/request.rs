//! What every request is made of before its method runs: who is calling (the bearer token's
//! identity, or a node's token) and a body parsed into the method's request type.

use axum::http::HeaderMap;
use serde::de::DeserializeOwned;
use serde_json::Value;
use subtle::ConstantTimeEq;
use vps_commands::Actor;
use vps_domain::ErrorCode;

use crate::config::IdentityConfig;
use crate::error::ApiError;
use crate::state::AppState;

/// Who is calling.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The identity.
    pub actor: Actor,
    /// Set when a node calls with its node token.
    pub node: Option<String>,
}

impl Caller {
    /// Refuses non-operators.
    pub fn operator(&self) -> Result<(), ApiError> {
        if self.actor.operator {
            Ok(())
        } else {
            Err(ApiError::new(ErrorCode::AccessDenied, "operators only"))
        }
    }

    /// The tenant a call acts for: a tenant identity acts only for its own tenant (another
    /// tenant's resources are `NOT_FOUND`); an operator names any.
    pub fn tenant(&self, requested: &str) -> Result<String, ApiError> {
        match &self.actor.tenant {
            _ if self.actor.operator => Ok(requested.to_string()),
            Some(own) if own == requested => Ok(own.clone()),
            _ => Err(ApiError::new(
                ErrorCode::NotFound,
                format!("tenant {requested} not found"),
            )),
        }
    }
}

/// Resolves the bearer token: a configured identity, a run-time identity's API key, or a
/// node's token. Secrets are compared in constant time; only hashes are stored.
pub async fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::Unauthenticated,
                "missing Authorization: Bearer <token>",
            )
        })?;
    if let Some(id) = configured(&state.config.identities, token) {
        return Ok(identity(&id.identity, id.tenant.clone(), id.operator));
    }
    if token.starts_with(vps_commands::identities::KEY_PREFIX) {
        let holder = vps_commands::identities::authenticate(&state.pool, token).await?;
        let holder = holder
            .ok_or_else(|| ApiError::new(ErrorCode::Unauthenticated, "unknown or revoked key"))?;
        return Ok(identity(
            &holder.identity_id,
            holder.tenant_id,
            holder.operator,
        ));
    }
    let token_hash = vps_commands::operator::token_hash(token);
    let node = vps_projections::views::node_by_token_hash(&state.pool, &token_hash).await?;
    let node = node.ok_or_else(|| ApiError::new(ErrorCode::Unauthenticated, "unknown token"))?;
    Ok(Caller {
        actor: Actor {
            identity: format!("node:{node}"),
            tenant: None,
            operator: false,
        },
        node: Some(node),
    })
}

/// The configured identity whose token this is, comparing every one in constant time.
fn configured<'a>(identities: &'a [IdentityConfig], token: &str) -> Option<&'a IdentityConfig> {
    let mut found = None;
    for id in identities {
        if bool::from(id.token.as_bytes().ct_eq(token.as_bytes())) {
            found = Some(id);
        }
    }
    found
}

fn identity(id: &str, tenant: Option<String>, operator: bool) -> Caller {
    Caller {
        actor: Actor {
            identity: id.to_string(),
            tenant,
            operator,
        },
        node: None,
    }
}

/// Parses a JSON body into `T`, naming the offending field. Strings may not hold NUL
/// characters (PostgreSQL text cannot store them).
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    // Most bodies are well-formed objects without a NUL (`\u0000` is the only way JSON can
    // carry one): read those straight into `T`, without the `Value` tree and the path
    // tracking, which made each entry of a host's report of 10,000 guests cost several times
    // its parse. Anything else, or a body `T` refuses, takes the path below for its answer.
    let object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    if object && memchr::memmem::find(body, br"\u0000").is_none() {
        if let Ok(parsed) = serde_json::from_slice(body) {
            return Ok(parsed);
        }
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value: Value = serde_path_to_error::deserialize(de).map_err(|e| refusal(&e))?;
    if !value.is_object() {
        return Err(ApiError::invalid("body", "a JSON object"));
    }
    if let Some(path) = nul_at(&value, String::new()) {
        return Err(ApiError::invalid(&path, "contains a NUL character"));
    }
    serde_path_to_error::deserialize(value).map_err(|e| refusal(&e))
}

fn refusal<E: std::fmt::Display>(e: &serde_path_to_error::Error<E>) -> ApiError {
    let path = e.path().to_string();
    let message = e.inner().to_string();
    if let Some(what) = vps_domain::ids::not_an_id(&message) {
        let what = what.to_string();
        return vps_domain::DomainError::NotFound { what }.into();
    }
    // A bounded field of a flattened struct names itself (its path is lost on the way).
    if let Some((field, message)) = vps_domain::bounds::field_of(&message) {
        let field = match path.as_str() {
            "." => field.to_string(),
            _ => format!("{path}.{field}"),
        };
        return ApiError::invalid(&field, message);
    }
    let field = if path == "." {
        "body".to_string()
    } else {
        path
    };
    ApiError::invalid(&field, message)
}

/// The path of the first string (or key) holding a NUL character.
fn nul_at(value: &Value, path: String) -> Option<String> {
    match value {
        Value::String(s) if s.contains('\0') => {
            Some(if path.is_empty() { "body".into() } else { path })
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| nul_at(v, format!("{path}[{i}]"))),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            let here = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            if k.contains('\0') {
                Some(here)
            } else {
                nul_at(v, here)
            }
        }),
        _ => None,
    }
}

impl Caller {
    /// The Cedar principal this caller is.
    pub fn principal(&self) -> vps_domain::authz::Principal {
        use vps_domain::authz::Principal;
        match &self.node {
            Some(node) => Principal::Node { id: node.clone() },
            None => Principal::Identity {
                id: self.actor.identity.clone(),
                tenant: self.actor.tenant.clone(),
                operator: self.actor.operator,
            },
        }
    }
}
