//! `pools.*`, `nodes.*` (operator side), `flavors.*`, `images.*`.

use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::Row;
use vps_commands::operator as ops;
use vps_commands::Ctx;
use vps_projections::views;

use crate::error::ApiError;
use crate::rpc::{parse, Caller};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolRef {
    pool_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UsageQuery {
    pool_id: String,
    tenant_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NodeRef {
    node_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NodeList {
    pool_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct FlavorRef {
    flavor_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ImageRef {
    image_id: String,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ImageList {
    tenant_id: Option<String>,
}

fn missing(what: &str, id: &str) -> ApiError {
    ApiError::new("NOT_FOUND", format!("{what} {id} not found"))
}

/// Dispatches an operator method. Tenants may list flavors and images; everything else is
/// for operators.
pub async fn handle(
    ctx: &Ctx,
    caller: &Caller,
    group: &str,
    method: &str,
    body: &[u8],
) -> Result<Value, ApiError> {
    let pool = &ctx.pool;
    match (group, method) {
        ("flavors", "list") => {
            let q: PoolRef = parse(body)?;
            if !caller.actor.operator {
                let tenant = caller.actor.tenant.clone().unwrap_or_default();
                let offered: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM quotas WHERE pool_id = $1 AND tenant_id = $2 AND offered)")
                    .bind(&q.pool_id)
                    .bind(&tenant)
                    .fetch_one(pool)
                    .await?;
                if !offered {
                    return Err(missing("pool", &q.pool_id));
                }
            }
            return Ok(json!({ "items": views::flavors(pool, &q.pool_id).await? }));
        }
        ("images", "list") => {
            let q: ImageList = parse(body)?;
            let tenant = if caller.actor.operator {
                q.tenant_id
            } else {
                caller.actor.tenant.clone()
            };
            return Ok(json!({ "items": views::images(pool, tenant.as_deref()).await? }));
        }
        _ => caller.operator()?,
    }
    Ok(match (group, method) {
        ("pools", "create") => ops::create_pool(ctx, parse(body)?).await?,
        ("pools", "get") => {
            let q: PoolRef = parse(body)?;
            views::pool(pool, &q.pool_id)
                .await?
                .ok_or_else(|| missing("pool", &q.pool_id))?
        }
        ("pools", "list") => {
            let _: Value = parse(body)?;
            json!({ "items": views::pools(pool).await? })
        }
        ("pools", "update") => ops::update_pool(ctx, parse(body)?).await?,
        ("pools", "offer") => ops::offer_pool(ctx, parse(body)?).await?,
        ("pools", "setIpPool") => ops::set_ip_pool(ctx, parse(body)?).await?,
        ("pools", "usage") => {
            let q: UsageQuery = parse(body)?;
            views::pool(pool, &q.pool_id)
                .await?
                .ok_or_else(|| missing("pool", &q.pool_id))?;
            let rows = sqlx::query(
                "SELECT tenant_id, resource, max, used FROM quotas WHERE pool_id = $1 AND ($2::text IS NULL OR tenant_id = $2)
                 ORDER BY tenant_id, resource",
            )
            .bind(&q.pool_id)
            .bind(&q.tenant_id)
            .fetch_all(pool)
            .await?;
            let items: Vec<Value> = rows
                .iter()
                .map(|r| json!({ "tenantId": r.get::<String, _>(0), "resource": r.get::<String, _>(1), "max": r.get::<i64, _>(2), "used": r.get::<i64, _>(3) }))
                .collect();
            json!({ "items": items })
        }
        ("pools", "leases") => {
            let q: PoolRef = parse(body)?;
            views::pool(pool, &q.pool_id)
                .await?
                .ok_or_else(|| missing("pool", &q.pool_id))?;
            let rows = sqlx::query("SELECT address, instance_id FROM ip_leases WHERE pool_id = $1 ORDER BY inet(address)")
                .bind(&q.pool_id)
                .fetch_all(pool)
                .await?;
            let items: Vec<Value> = rows.iter().map(|r| json!({ "address": r.get::<String, _>(0), "instanceId": r.get::<String, _>(1) })).collect();
            json!({ "items": items })
        }
        ("nodes", "register") => ops::register_node(ctx, parse(body)?).await?,
        ("nodes", "get") => {
            let q: NodeRef = parse(body)?;
            views::node(pool, &q.node_id)
                .await?
                .ok_or_else(|| missing("node", &q.node_id))?
        }
        ("nodes", "list") => {
            let q: NodeList = parse(body)?;
            json!({ "items": views::nodes(pool, q.pool_id.as_deref()).await? })
        }
        ("nodes", "cordon") => ops::set_cordon(ctx, &parse::<NodeRef>(body)?.node_id, true).await?,
        ("nodes", "uncordon") => {
            ops::set_cordon(ctx, &parse::<NodeRef>(body)?.node_id, false).await?
        }
        ("flavors", "create") => ops::create_flavor(ctx, parse(body)?).await?,
        ("flavors", "archive") => {
            ops::archive_flavor(ctx, &parse::<FlavorRef>(body)?.flavor_id).await?
        }
        ("images", "register") => ops::register_image(ctx, parse(body)?).await?,
        ("images", "delete") => ops::delete_image(ctx, &parse::<ImageRef>(body)?.image_id).await?,
        _ => {
            return Err(ApiError::new(
                "NOT_FOUND",
                format!("no method {group}.{method}"),
            ))
        }
    })
}
