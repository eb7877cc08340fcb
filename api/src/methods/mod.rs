//! The API's methods, one module per group; each module declares its methods once
//! ([`crate::registry::Method`]) and the registry collects them here.

pub mod common;
pub mod events;
pub mod flavors;
pub mod forks;
pub mod identities;
pub mod images;
pub mod instances;
pub mod nodes;
pub mod policies;
pub mod pools;
pub mod previews;
pub mod provider_accounts;
pub mod sandbox_exec;
pub mod sandboxes;
pub mod snapshots;
pub mod tenants;
pub mod usage;
pub mod volumes;
pub mod webhooks;

use std::sync::LazyLock;

use vps_domain::ErrorCode;

use crate::error::ApiError;
use crate::registry::{Call, Method, Registry};

/// Every method of the API, group by group.
pub fn all() -> Vec<Method> {
    [
        pools::methods(),
        nodes::methods(),
        flavors::methods(),
        images::methods(),
        instances::methods(),
        sandboxes::methods(),
        snapshots::methods(),
        sandbox_exec::methods(),
        previews::methods(),
        forks::methods(),
        volumes::methods(),
        provider_accounts::methods(),
        webhooks::methods(),
        events::methods(),
        policies::methods(),
        identities::methods(),
        tenants::methods(),
        usage::methods(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The registry of this build's API.
pub fn registry() -> &'static Registry {
    static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Registry::new(all()));
    &REGISTRY
}

/// Whose resources a list shows when `scope` is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The caller's own.
    Mine,
    /// The whole tenant's.
    All,
}

/// The owner a list filters on: `scope` `mine` (the caller) or `all` (none).
pub fn scope_owner(
    c: &Call,
    scope: Option<&str>,
    default: Scope,
) -> Result<Option<String>, ApiError> {
    let mine = Some(c.caller.actor.identity.clone());
    match (scope, default) {
        (Some("mine"), _) | (None, Scope::Mine) => Ok(mine),
        (Some("all"), _) | (None, Scope::All) => Ok(None),
        (Some(_), _) => Err(ApiError::invalid("scope", "mine or all")),
    }
}

/// A page's size: `limit`, 1 to 200, 50 by default.
pub fn page_limit(limit: Option<i64>) -> Result<i64, ApiError> {
    let limit = limit.unwrap_or(50);
    if (1..=200).contains(&limit) {
        Ok(limit)
    } else {
        Err(ApiError::invalid("limit", "1 to 200"))
    }
}

/// Cuts a page read with one row more than `limit`: the rows, and the cursor of the last one
/// when more remain.
pub fn split_page<T>(
    mut items: Vec<T>,
    limit: i64,
    cursor: impl Fn(&T) -> String,
) -> (Vec<T>, Option<String>) {
    let more = items.len() as i64 > limit;
    items.truncate(limit as usize);
    let cursor = more.then(|| items.last().map(cursor)).flatten();
    (items, cursor)
}

/// An opaque page cursor: the last item's id, bound to the list and the tenant it was read
/// for and signed with a key derived from the sealing key. Another tenant's ids, another
/// list's cursor or an edited one are refused alike, so a cursor tells nothing about what
/// exists outside the caller's own list.
pub fn sign_cursor(c: &Call, list: &str, tenant: &str, id: &str) -> String {
    let payload = serde_json::json!([list, tenant, id]).to_string();
    let mac = c.ctx.secrets.digest(CURSOR_PURPOSE, payload.as_bytes());
    format!(
        "{}.{}",
        data_encoding::HEXLOWER.encode(payload.as_bytes()),
        mac.get(..32).unwrap_or(&mac)
    )
}

/// The id a cursor of [`sign_cursor`] names, when it was made for this `list` and `tenant`;
/// `INVALID_INPUT` on `cursor` otherwise.
pub fn open_cursor(c: &Call, list: &str, tenant: &str, cursor: &str) -> Result<String, ApiError> {
    let bad = || ApiError::invalid("cursor", "not a cursor from a previous page of this list");
    let (payload, mac) = cursor.split_once('.').ok_or_else(bad)?;
    let payload = data_encoding::HEXLOWER_PERMISSIVE
        .decode(payload.as_ref())
        .map_err(|_| bad())?;
    let expected = c.ctx.secrets.digest(CURSOR_PURPOSE, &payload);
    let expected = expected.get(..32).unwrap_or(&expected);
    if !bool::from(subtle::ConstantTimeEq::ct_eq(
        expected.as_bytes(),
        mac.as_bytes(),
    )) {
        return Err(bad());
    }
    let (l, t, id): (String, String, String) =
        serde_json::from_slice(&payload).map_err(|_| bad())?;
    if l != list || t != tenant {
        return Err(bad());
    }
    Ok(id)
}

const CURSOR_PURPOSE: &str = "vps list cursor v1";

/// `NOT_FOUND` for a named resource.
pub fn missing(what: &str, id: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("{what} {id} not found"))
}
