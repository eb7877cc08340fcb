//! The `pools` table and the quota maxima of offers (`quotas`), from a pool's stream.

use sqlx::types::Json;
use sqlx::PgConnection;
use std::net::Ipv4Addr;

use vps_domain::ipam::{leasable_addresses, Ipv4Cidr};
use vps_domain::operator::IpRangeSet;
use vps_domain::pool::PoolEvent;
use vps_domain::quota::Amounts;
use vps_domain::resources::QuotaResource;
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one pool event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let at = e.recorded_at;
    match crate::typed::<PoolEvent>(e)? {
        PoolEvent::Created(d) => {
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
        PoolEvent::Updated(d) => {
            sqlx::query("UPDATE pools SET name = $2, policy = $3, updated_at = $4, version = $5 WHERE id = $1")
            .bind(&d.pool_id)
            .bind(&d.name)
            .bind(Json(&d.policy))
            .bind(at)
            .bind(e.version)
            .execute(conn)
            .await?;
        }
        PoolEvent::IpRangeSet(d) => {
            sqlx::query("UPDATE pools SET ip_cidr = $2, ip_gateway = $3, updated_at = $4, version = $5 WHERE id = $1")
            .bind(&d.pool_id)
            .bind(&d.cidr)
            .bind(&d.gateway)
            .bind(at)
            .bind(e.version)
            .execute(&mut *conn)
            .await?;
            free_list(conn, &d).await?;
        }
        PoolEvent::Offered(d) => {
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
    }
    Ok(())
}

/// Makes the pool's free list the range's leasable addresses that no instance leases.
async fn free_list(conn: &mut PgConnection, range: &IpRangeSet) -> Result<(), ProjectionError> {
    let cidr = Ipv4Cidr::parse(&range.cidr).map_err(|e| ProjectionError::Malformed {
        event_id: range.pool_id.clone(),
        event_type: "pool.ip_range.set".into(),
        message: e.to_string(),
    })?;
    let gateway: Ipv4Addr = range.gateway.parse().unwrap_or(cidr.default_gateway());
    let addresses: Vec<String> = leasable_addresses(&cidr, gateway)
        .map(|a| a.to_string())
        .collect();
    sqlx::query("DELETE FROM ip_free WHERE pool_id = $1")
        .bind(&range.pool_id)
        .execute(&mut *conn)
        .await?;
    sqlx::query(
        "INSERT INTO ip_free (pool_id, address)
         SELECT $1, a FROM unnest($2::text[]) AS a
          WHERE NOT EXISTS (SELECT 1 FROM ip_leases l WHERE l.pool_id = $1 AND l.address = a)",
    )
    .bind(&range.pool_id)
    .bind(&addresses)
    .execute(conn)
    .await?;
    Ok(())
}

/// A tenant's quota maxima and usage in a pool.
pub async fn quota(
    tx: &mut PgConnection,
    pool_id: &str,
    tenant_id: &str,
) -> Result<(Amounts, Amounts), sqlx::Error> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT resource, max, used FROM quotas WHERE pool_id = $1 AND tenant_id = $2",
    )
    .bind(pool_id)
    .bind(tenant_id)
    .fetch_all(&mut *tx)
    .await?;
    Ok(amounts(rows))
}

/// Quota rows `(resource, max, used)` as maxima and usage.
pub fn amounts(rows: Vec<(String, i64, i64)>) -> (Amounts, Amounts) {
    let (mut max, mut used) = (Amounts::new(), Amounts::new());
    for (resource, m, u) in rows {
        if let Some(resource) = QuotaResource::parse(&resource) {
            max.insert(resource, m.max(0) as u64);
            used.insert(resource, u.max(0) as u64);
        }
    }
    (max, used)
}

/// A pool's runtime; `None` when it names none or there is no such pool.
pub async fn runtime(tx: &mut PgConnection, pool_id: &str) -> Result<Option<String>, sqlx::Error> {
    let runtime: Option<Option<String>> =
        sqlx::query_scalar("SELECT runtime FROM pools WHERE id = $1")
            .bind(pool_id)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(runtime.flatten())
}

/// A pool's provider account; `None` when it has none or there is no such pool.
pub async fn provider_account_id(
    tx: &mut PgConnection,
    pool_id: &str,
) -> Result<Option<String>, sqlx::Error> {
    let account: Option<Option<String>> =
        sqlx::query_scalar("SELECT provider_account_id FROM pools WHERE id = $1")
            .bind(pool_id)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(account.flatten())
}

/// A pool's policy document; `RowNotFound` when there is no such pool.
pub async fn policy(
    tx: &mut PgConnection,
    pool_id: &str,
) -> Result<serde_json::Value, sqlx::Error> {
    sqlx::query_scalar("SELECT policy FROM pools WHERE id = $1")
        .bind(pool_id)
        .fetch_one(&mut *tx)
        .await
}

/// The pool named `name`; `None` when there is none.
pub async fn id_by_name<'e>(
    db: impl sqlx::PgExecutor<'e>,
    name: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM pools WHERE name = $1")
        .bind(name)
        .fetch_optional(db)
        .await
}
