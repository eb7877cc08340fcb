//! Reading projections as the API shows them (camelCase JSON).

use serde_json::{json, Value};
use sqlx::{PgExecutor, Row};
use vps_domain::instance::Instance;

/// A pool, or `None`.
pub async fn pool<'e>(db: impl PgExecutor<'e>, id: &str) -> Result<Option<Value>, sqlx::Error> {
    Ok(sqlx::query(&format!("{POOL_SELECT} WHERE id = $1"))
        .bind(id)
        .fetch_optional(db)
        .await?
        .map(|r| pool_json(&r)))
}

/// Every pool, by name.
pub async fn pools<'e>(db: impl PgExecutor<'e>) -> Result<Vec<Value>, sqlx::Error> {
    Ok(sqlx::query(&format!("{POOL_SELECT} ORDER BY name"))
        .fetch_all(db)
        .await?
        .iter()
        .map(pool_json)
        .collect())
}

const POOL_SELECT: &str = "SELECT id, name, class, runtime, policy, provider_account_id, ip_cidr, ip_gateway, created_at, updated_at, version FROM pools";

fn pool_json(r: &sqlx::postgres::PgRow) -> Value {
    let cidr: Option<String> = r.get(6);
    json!({
        "id": r.get::<String, _>(0),
        "name": r.get::<String, _>(1),
        "class": r.get::<String, _>(2),
        "runtime": r.get::<Option<String>, _>(3),
        "policy": r.get::<Value, _>(4),
        "providerAccountId": r.get::<Option<String>, _>(5),
        "ipPool": cidr.map(|c| json!({ "cidr": c, "gateway": r.get::<Option<String>, _>(7) })),
        "createdAt": r.get::<chrono::DateTime<chrono::Utc>, _>(8),
        "updatedAt": r.get::<chrono::DateTime<chrono::Utc>, _>(9),
        "version": r.get::<i64, _>(10),
    })
}

/// A node with what is allocated on it, or `None`.
pub async fn node<'e>(db: impl PgExecutor<'e>, id: &str) -> Result<Option<Value>, sqlx::Error> {
    Ok(
        sqlx::query(&format!("{NODE_SELECT} WHERE n.id = $1 GROUP BY n.id"))
            .bind(id)
            .fetch_optional(db)
            .await?
            .map(|r| node_json(&r)),
    )
}

/// Nodes, optionally of one pool, by name.
pub async fn nodes<'e>(
    db: impl PgExecutor<'e>,
    pool_id: Option<&str>,
) -> Result<Vec<Value>, sqlx::Error> {
    Ok(sqlx::query(&format!("{NODE_SELECT} WHERE ($1::text IS NULL OR n.pool_id = $1) GROUP BY n.id ORDER BY n.name, n.id"))
        .bind(pool_id)
        .fetch_all(db)
        .await?
        .iter()
        .map(node_json)
        .collect())
}

const NODE_SELECT: &str = "SELECT n.id, n.pool_id, n.name, n.state, n.capacity, n.labels, n.runtimes, n.cpu_model, (SELECT h.last_report_at FROM node_heartbeats h WHERE h.node_id = n.id),
        coalesce(sum(a.vcpu), 0)::bigint, coalesce(sum(a.memory_gib), 0)::bigint, coalesce(sum(a.disk_gib), 0)::bigint,
        coalesce(jsonb_agg(jsonb_build_object('model', a.gpu_model, 'count', a.gpus)) FILTER (WHERE a.gpus > 0), '[]'),
        n.orphans
   FROM nodes n LEFT JOIN node_allocations a ON a.node_id = n.id";

fn node_json(r: &sqlx::postgres::PgRow) -> Value {
    json!({
        "id": r.get::<String, _>(0),
        "poolId": r.get::<String, _>(1),
        "name": r.get::<String, _>(2),
        "state": r.get::<String, _>(3),
        "capacity": r.get::<Value, _>(4),
        "labels": r.get::<Value, _>(5),
        "runtimes": r.get::<Value, _>(6),
        "cpuModel": r.get::<Option<String>, _>(7),
        "lastReportAt": r.get::<Option<chrono::DateTime<chrono::Utc>>, _>(8),
        "orphans": r.get::<Value, _>(13),
        "allocated": { "vcpu": r.get::<i64, _>(9), "memoryGiB": r.get::<i64, _>(10), "diskGiB": r.get::<i64, _>(11), "gpus": r.get::<Value, _>(12) },
    })
}

/// Flavors of a pool, by name.
pub async fn flavors<'e>(
    db: impl PgExecutor<'e>,
    pool_id: &str,
) -> Result<Vec<Value>, sqlx::Error> {
    let rows = sqlx::query("SELECT id, pool_id, name, shape, offer_id, archived, created_at FROM flavors WHERE pool_id = $1 ORDER BY name")
        .bind(pool_id)
        .fetch_all(db)
        .await?;
    Ok(rows.iter().map(flavor_json).collect())
}

/// One flavor by id.
pub async fn flavor<'e>(db: impl PgExecutor<'e>, id: &str) -> Result<Option<Value>, sqlx::Error> {
    let row = sqlx::query("SELECT id, pool_id, name, shape, offer_id, archived, created_at FROM flavors WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await?;
    Ok(row.map(|r| flavor_json(&r)))
}

fn flavor_json(r: &sqlx::postgres::PgRow) -> Value {
    let mut shape: Value = r.get(3);
    let flavor = json!({
        "id": r.get::<String, _>(0),
        "poolId": r.get::<String, _>(1),
        "name": r.get::<String, _>(2),
        "offerId": r.get::<Option<String>, _>(4),
        "archived": r.get::<bool, _>(5),
        "createdAt": r.get::<chrono::DateTime<chrono::Utc>, _>(6),
    });
    if let (Some(s), Some(f)) = (shape.as_object_mut(), flavor.as_object()) {
        s.extend(f.clone());
    }
    shape
}

/// Images a caller can see: a tenant's own and public ones (operators: all), not deleted.
pub async fn images<'e>(
    db: impl PgExecutor<'e>,
    tenant_id: Option<&str>,
) -> Result<Vec<Value>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, tenant_id, url, sha256, format, verified, created_at FROM images
          WHERE NOT deleted AND ($1::text IS NULL OR tenant_id = $1 OR tenant_id IS NULL) ORDER BY id",
    )
    .bind(tenant_id)
    .fetch_all(db)
    .await?;
    Ok(rows
        .iter()
        .map(|r| {
            json!({
                "id": r.get::<String, _>(0),
                "tenantId": r.get::<Option<String>, _>(1),
                "public": r.get::<Option<String>, _>(1).is_none(),
                "url": r.get::<String, _>(2),
                "sha256": r.get::<String, _>(3),
                "format": r.get::<String, _>(4),
                "verified": r.get::<bool, _>(5),
                "createdAt": r.get::<chrono::DateTime<chrono::Utc>, _>(6),
            })
        })
        .collect())
}

/// The public view of an instance (SPEC §3.2).
pub fn instance_json(i: &Instance) -> Value {
    json!({
        "id": i.id,
        "tenantId": i.tenant_id,
        "poolId": i.pool_id,
        "state": i.state,
        "desiredState": i.desired_state,
        "flavor": i.flavor,
        "imageId": i.image_id,
        "sshKeys": i.ssh_keys,
        "addresses": i.addresses,
        "conditions": i.conditions,
        "nodeId": i.node_id,
        "allocationId": i.allocation_id,
        "externalId": i.external_id,
        "projectId": i.project_id,
        "ownerIdentityId": i.owner_identity_id,
        "idempotencyKey": i.idempotency_key,
        "createdAt": i.created_at,
        "updatedAt": i.updated_at,
        "version": i.version,
    })
}
