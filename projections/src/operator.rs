//! Pools, quota maxima (offers), nodes, flavors and images.

use sqlx::types::Json;
use sqlx::PgConnection;
use vps_domain::operator::*;
use vps_domain::resources::QuotaResource;
use vps_events::RecordedEvent;

use crate::{data, ProjectionError};

/// Applies one operator event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let at = e.recorded_at;
    match e.event_type.as_str() {
        "pool.created" => {
            let d: PoolCreated = data(e)?;
            sqlx::query(
                "INSERT INTO pools (id, name, class, runtime, policy, provider_account_id,
                                    created_at, updated_at, version)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8)",
            )
            .bind(&d.pool_id)
            .bind(&d.name)
            .bind(&d.class)
            .bind(&d.runtime)
            .bind(Json(&d.policy))
            .bind(&d.provider_account_id)
            .bind(at)
            .bind(e.version)
            .execute(conn)
            .await?;
        }
        "pool.updated" => {
            let d: PoolUpdated = data(e)?;
            sqlx::query("UPDATE pools SET name = $2, policy = $3, updated_at = $4, version = $5 WHERE id = $1")
                .bind(&d.pool_id)
                .bind(&d.name)
                .bind(Json(&d.policy))
                .bind(at)
                .bind(e.version)
                .execute(conn)
                .await?;
        }
        "pool.ip_range.set" => {
            let d: IpRangeSet = data(e)?;
            sqlx::query("UPDATE pools SET ip_cidr = $2, ip_gateway = $3, updated_at = $4, version = $5 WHERE id = $1")
                .bind(&d.pool_id)
                .bind(&d.cidr)
                .bind(&d.gateway)
                .bind(at)
                .bind(e.version)
                .execute(conn)
                .await?;
        }
        "pool.offered" => {
            let d: PoolOffered = data(e)?;
            for resource in QuotaResource::ALL {
                let max = d.quota.get(resource.as_str()).copied().unwrap_or(0) as i64;
                sqlx::query(
                    "INSERT INTO quotas (pool_id, tenant_id, resource, max, offered)
                     VALUES ($1, $2, $3, $4, true)
                     ON CONFLICT (pool_id, tenant_id, resource)
                     DO UPDATE SET max = excluded.max, offered = true",
                )
                .bind(&d.pool_id)
                .bind(&d.tenant_id)
                .bind(resource.as_str())
                .bind(max)
                .execute(&mut *conn)
                .await?;
            }
            sqlx::query("UPDATE pools SET updated_at = $2, version = $3 WHERE id = $1")
                .bind(&d.pool_id)
                .bind(at)
                .bind(e.version)
                .execute(conn)
                .await?;
        }
        "node.registered" => {
            let d: NodeRegistered = data(e)?;
            sqlx::query(
                "INSERT INTO nodes (id, pool_id, name, state, capacity, labels, runtimes, cpu_model,
                                    token_hash, created_at, updated_at, version)
                 VALUES ($1, $2, $3, 'ready', $4, $5, $6, $7, $8, $9, $9, $10)",
            )
            .bind(&d.node_id)
            .bind(&d.pool_id)
            .bind(&d.name)
            .bind(Json(&d.capacity))
            .bind(Json(&d.labels))
            .bind(Json(&d.runtimes))
            .bind(&d.cpu_model)
            .bind(&d.token_hash)
            .bind(at)
            .bind(e.version)
            .execute(conn)
            .await?;
        }
        "node.cordoned" | "node.uncordoned" | "node.lost" | "node.recovered" => {
            let d: NodeStateChanged = data(e)?;
            let state = match e.event_type.as_str() {
                "node.cordoned" => "cordoned",
                "node.lost" => "lost",
                _ => "ready",
            };
            sqlx::query("UPDATE nodes SET state = $2, updated_at = $3, version = $4 WHERE id = $1")
                .bind(&d.node_id)
                .bind(state)
                .bind(at)
                .bind(e.version)
                .execute(conn)
                .await?;
        }
        "instance.orphaned" => {
            let d: vps_domain::operator::OrphansChanged = data(e)?;
            sqlx::query("UPDATE nodes SET orphans = $2, version = $3 WHERE id = $1")
                .bind(&d.node_id)
                .bind(Json(&d.instance_ids))
                .bind(e.version)
                .execute(conn)
                .await?;
        }
        "flavor.created" => {
            let d: FlavorCreated = data(e)?;
            sqlx::query(
                "INSERT INTO flavors (id, pool_id, name, shape, offer_id, archived, created_at, version)
                 VALUES ($1, $2, $3, $4, $5, false, $6, $7)",
            )
            .bind(&d.flavor_id)
            .bind(&d.pool_id)
            .bind(&d.name)
            .bind(Json(&d.shape))
            .bind(&d.offer_id)
            .bind(at)
            .bind(e.version)
            .execute(conn)
            .await?;
        }
        "flavor.archived" => {
            let d: FlavorArchived = data(e)?;
            sqlx::query("UPDATE flavors SET archived = true, version = $2 WHERE id = $1")
                .bind(&d.flavor_id)
                .bind(e.version)
                .execute(conn)
                .await?;
        }
        "image.registered" => {
            let d: ImageRegistered = data(e)?;
            sqlx::query(
                "INSERT INTO images (id, tenant_id, url, sha256, format, verified, deleted, created_at, version)
                 VALUES ($1, $2, $3, $4, $5, $6, false, $7, $8)
                 ON CONFLICT (id) DO UPDATE SET tenant_id = excluded.tenant_id, url = excluded.url,
                    sha256 = excluded.sha256, format = excluded.format, verified = excluded.verified,
                    deleted = false, version = excluded.version",
            )
            .bind(&d.image_id)
            .bind(&d.tenant_id)
            .bind(&d.url)
            .bind(&d.sha256)
            .bind(&d.format)
            .bind(d.verified)
            .bind(at)
            .bind(e.version)
            .execute(conn)
            .await?;
        }
        "image.deleted" => {
            let d: ImageDeleted = data(e)?;
            sqlx::query("UPDATE images SET deleted = true, version = $2 WHERE id = $1")
                .bind(&d.image_id)
                .bind(e.version)
                .execute(conn)
                .await?;
        }
        _ => {}
    }
    Ok(())
}
