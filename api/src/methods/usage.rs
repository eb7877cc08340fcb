//! `usage.list`: the `usage.recorded` records billing pipelines read (SPEC §5.1). Tenants read
//! their own; operators any tenant's, or every tenant's.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vps_domain::ErrorCode;
use vps_projections::usage::{self as views, UsageGroup, UsageItem, UsageQuery, MAX_PAGE};

use crate::error::ApiError;
use crate::registry::{Access::Tenant, Call, Method};

/// `usage.list`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListUsage {
    /// Operators: one tenant (absent: every tenant); tenants: their own (the default).
    tenant_id: Option<String>,
    /// Records whose window starts at or after this (RFC 3339)…
    from: DateTime<Utc>,
    /// …and before this.
    to: DateTime<Utc>,
    /// Only this meter (`vps.vcpu.hours`).
    meter: Option<String>,
    /// Only this resource (`inst_…`).
    resource_id: Option<String>,
    /// 1 to 1000 (default 100).
    limit: Option<i64>,
    /// Where the previous page stopped.
    cursor: Option<String>,
    /// `label:<key>`: instead of records, the sums per value of that label, meter and unit
    /// (`groups`; cost per label). `limit` and `cursor` do not apply.
    group_by: Option<String>,
}

/// A page of usage records.
#[derive(Serialize, schemars::JsonSchema)]
pub struct UsagePage {
    /// Records by window start, then id.
    items: Vec<UsageItem>,
    /// Present when more may follow: pass it as `cursor`.
    #[serde(skip_serializing_if = "Option::is_none")]
    cursor: Option<String>,
    /// With `groupBy`: the sums per label value, meter and unit (`items` is then empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    groups: Option<Vec<UsageGroup>>,
}

/// The label key of a `groupBy` (`label:<key>`), checked like a label key.
pub fn group_key(group_by: &str) -> Result<String, ApiError> {
    let key = group_by
        .strip_prefix("label:")
        .ok_or_else(|| ApiError::invalid("groupBy", "label:<key>, e.g. label:team"))?;
    let probe = vps_domain::labels::Labels::from([(key.to_string(), String::new())]);
    vps_domain::labels::check("groupBy", &probe).map_err(vps_commands::CommandError::from)?;
    Ok(key.to_string())
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![Method::new(
        "usage",
        "list",
        Tenant,
        "Usage records (usage.recorded) by window start.",
        list,
    )]
}

async fn list(c: Call, q: ListUsage) -> Result<UsagePage, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid("limit", "1 to 1000"));
    }
    in_range("from", q.from)?;
    in_range("to", q.to)?;
    if q.from > q.to {
        return Err(ApiError::invalid("to", "must not be before `from`"));
    }
    let tenant_id = match (&q.tenant_id, c.caller.actor.operator) {
        (Some(t), _) => Some(c.caller.tenant(t)?),
        (None, true) => None,
        (None, false) => c.caller.actor.tenant.clone(),
    };
    if tenant_id.is_none() && !c.caller.actor.operator {
        return Err(ApiError::new(
            ErrorCode::AccessDenied,
            "nodes do not read usage",
        ));
    }
    let group = q.group_by.as_deref().map(group_key).transpose()?;
    let query = UsageQuery {
        tenant_id,
        from: q.from,
        to: q.to,
        meter: q.meter,
        resource_id: q.resource_id,
        after: q.cursor.as_deref().map(parse_cursor).transpose()?,
        limit,
    };
    if let Some(key) = group {
        let groups = views::group_by_label(&c.ctx.pool, &query, &key).await?;
        return Ok(UsagePage {
            items: Vec::new(),
            cursor: None,
            groups: Some(groups),
        });
    }
    let items = views::list(&c.ctx.pool, &query).await?;
    let cursor = (items.len() as i64 == limit)
        .then(|| {
            items
                .last()
                .map(|i| format!("{}~{}", i.window_start.timestamp_micros(), i.id))
        })
        .flatten();
    Ok(UsagePage {
        items,
        cursor,
        groups: None,
    })
}

/// Refuses times the database cannot hold (it stores years 1 to 9999 here).
fn in_range(field: &str, t: DateTime<Utc>) -> Result<(), ApiError> {
    use chrono::Datelike;
    if (1..=9999).contains(&t.year()) {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            "a time between the years 1 and 9999",
        ))
    }
}

fn parse_cursor(cursor: &str) -> Result<(DateTime<Utc>, String), ApiError> {
    let bad = || ApiError::invalid("cursor", "not a cursor from this API");
    let (micros, id) = cursor.split_once('~').ok_or_else(bad)?;
    let start = micros
        .parse()
        .ok()
        .and_then(DateTime::from_timestamp_micros)
        .ok_or_else(bad)?;
    in_range("cursor", start).map_err(|_| bad())?;
    Ok((start, id.to_string()))
}
