//! What admission reads: a create's facts in one statement (the pool, the flavor's shape, the
//! image, the tenant's quota, the pool's nodes with their bookings and a run of free
//! addresses), the pool's nodes alone, and free addresses claimed for a transaction.
//! Decisions on these facts are the commands' (`vps_commands::instances::facts`).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::instance::{AdmissionPool, Instance, PoolKind};
use vps_domain::placement::{NodeCandidate, NodeState};
use vps_domain::quota::Amounts;
use vps_domain::resources::{Capacity, Gpus, Shape};

use crate::pools::amounts;

/// What a create names and what its read takes besides, so a batch's first create reads
/// everything in one round trip: the pool's nodes with their bookings (`nodes`), up to
/// `addresses` free addresses other than `held` (each locked to the transaction's end, see
/// [`free_addresses`]), and the instances of ids `instances` (replays and conflicts).
#[derive(Debug, Clone, Copy)]
pub struct CreateRead<'a> {
    /// The pool.
    pub pool_id: &'a str,
    /// The tenant.
    pub tenant_id: &'a str,
    /// The flavor's name in the pool.
    pub flavor: &'a str,
    /// The image.
    pub image_id: &'a str,
    /// Whether to read the pool's nodes.
    pub nodes: bool,
    /// How many free addresses to claim.
    pub addresses: i64,
    /// Addresses this transaction already holds.
    pub held: &'a [String],
    /// Instances to read by id.
    pub instances: &'a [String],
}

/// What a create names, as it stands: the pool (when offered to the tenant), the flavor's
/// shape, whether the image is the tenant's to use, and the tenant's quota in the pool; with
/// [`CreateRead`]'s extras, also the pool's nodes and a run of its free addresses.
#[derive(Debug)]
pub struct CreateFacts {
    /// The pool, when offered to the tenant and of a class admission knows.
    pub pool: Option<AdmissionPool>,
    /// The flavor's shape, when it exists and is not archived.
    pub shape: Option<Shape>,
    /// The image, when the tenant may use it: whether it is verified.
    pub image: Option<bool>,
    /// The tenant's quota maxima and usage in the pool.
    pub quota: (Amounts, Amounts),
    /// The pool's nodes with their bookings.
    pub nodes: Vec<NodeCandidate>,
    /// Free addresses claimed.
    pub addresses: Vec<Ipv4Addr>,
    /// The instances of [`CreateRead::instances`] that exist.
    pub existing: Vec<Instance>,
}

/// Reads [`CreateFacts`] in one statement: one row per node read (or one row without a node).
pub async fn create_facts(
    tx: &mut PgConnection,
    read: &CreateRead<'_>,
) -> Result<CreateFacts, sqlx::Error> {
    let nodes = booked("SELECT * FROM nodes WHERE pool_id = $1 AND $7");
    let rows = sqlx::query(&format!(
        "WITH f AS (
           SELECT p.class, p.runtime, p.provider_account_id IS NOT NULL, p.ip_cidr IS NOT NULL,
                EXISTS (SELECT 1 FROM quotas q WHERE q.pool_id = $1 AND q.tenant_id = $2 AND q.offered),
                (SELECT f.shape FROM flavors f WHERE f.pool_id = $1 AND f.name = $3 AND NOT f.archived),
                (SELECT i.verified FROM images i WHERE i.id = $4 AND NOT i.deleted
                          AND (i.tenant_id = $2 OR i.tenant_id IS NULL)),
                (SELECT coalesce(jsonb_agg(jsonb_build_array(q.resource, q.max, q.used)), '[]')
                   FROM quotas q WHERE q.pool_id = $1 AND q.tenant_id = $2),
                (SELECT coalesce(jsonb_agg(i.doc), '[]') FROM instances i WHERE i.id = ANY($8))
           FROM (SELECT 1) AS one LEFT JOIN pools p ON p.id = $1
         ), a AS MATERIALIZED (
           SELECT coalesce(array_agg(address), '{{}}') FROM ({claimed}) claimed
         )
         SELECT f.*, a.*, c.* FROM f CROSS JOIN a LEFT JOIN ({nodes}) c ON true",
        claimed = claimable("$6", "$5", "FOR UPDATE SKIP LOCKED"),
    ))
    .bind(read.pool_id)
    .bind(read.tenant_id)
    .bind(read.flavor)
    .bind(read.image_id)
    .bind(read.addresses)
    .bind(read.held)
    .bind(read.nodes)
    .bind(read.instances)
    .fetch_all(&mut *tx)
    .await?;
    let row = rows.first().ok_or(sqlx::Error::RowNotFound)?;
    let offered: bool = row.get(4);
    let pool = row
        .get::<Option<String>, _>(0)
        .filter(|_| offered)
        .and_then(|class| admission_pool(&class, row.get(1), row.get(2), row.get(3)));
    let Json(quota_rows): Json<Vec<(String, i64, i64)>> = row.get(7);
    let existing = crate::instance_doc::instances(row.get(8));
    let addresses: Vec<String> = row.get(9);
    Ok(CreateFacts {
        pool,
        shape: row.get::<Option<Json<Shape>>, _>(5).map(|Json(s)| s),
        image: row.get(6),
        quota: amounts(quota_rows),
        nodes: rows
            .iter()
            .filter(|r| r.get::<Option<String>, _>(FACT_COLUMNS).is_some())
            .map(|r| candidate(r, FACT_COLUMNS))
            .collect(),
        addresses: addresses.iter().filter_map(|a| a.parse().ok()).collect(),
        existing,
    })
}

/// The columns of [`create_facts`]'s rows before a node's.
const FACT_COLUMNS: usize = 10;

/// A pool row as admission sees it; `None` for a class admission does not know.
pub fn admission_pool(
    class: &str,
    runtime: Option<String>,
    has_account: bool,
    has_range: bool,
) -> Option<AdmissionPool> {
    let kind = match class {
        "vps-host" => PoolKind::Hosted,
        "provider" => PoolKind::Provider,
        _ => return None,
    };
    Some(AdmissionPool {
        kind,
        runtime: runtime.unwrap_or_else(|| "libvirt-kvm".into()),
        has_account,
        has_range,
    })
}

/// A pool as admission sees it.
pub async fn pool(
    tx: &mut PgConnection,
    pool_id: &str,
) -> Result<Option<AdmissionPool>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT class, runtime, provider_account_id IS NOT NULL, ip_cidr IS NOT NULL
           FROM pools WHERE id = $1",
    )
    .bind(pool_id)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(row.and_then(|r| admission_pool(&r.get::<String, _>(0), r.get(1), r.get(2), r.get(3))))
}

/// A pool as a volume's admission sees it (no account, no range), when offered to the tenant.
pub async fn offered_pool(
    tx: &mut PgConnection,
    pool_id: &str,
    tenant_id: &str,
) -> Result<Option<AdmissionPool>, sqlx::Error> {
    let pool: Option<(String, Option<String>, bool)> = sqlx::query_as(
        "SELECT class, runtime,
                EXISTS (SELECT 1 FROM quotas q WHERE q.pool_id = p.id AND q.tenant_id = $2 AND q.offered)
           FROM pools p WHERE p.id = $1",
    )
    .bind(pool_id)
    .bind(tenant_id)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(pool
        .filter(|(_, _, offered)| *offered)
        .and_then(|(class, runtime, _)| admission_pool(&class, runtime, false, false)))
}

/// The pool's nodes with what is booked on them; with `lock`, only that node, locked.
pub async fn candidates(
    tx: &mut PgConnection,
    pool_id: &str,
    lock: Option<&str>,
) -> Result<Vec<NodeCandidate>, sqlx::Error> {
    let nodes = match lock {
        None => "SELECT * FROM nodes WHERE pool_id = $1",
        Some(_) => "SELECT * FROM nodes WHERE pool_id = $1 AND id = $2 FOR UPDATE",
    };
    let rows = sqlx::query(&booked(nodes))
        .bind(pool_id)
        .bind(lock)
        .fetch_all(&mut *tx)
        .await?;
    Ok(rows.iter().map(|r| candidate(r, 0)).collect())
}

/// The nodes `ids` with what is booked on them, each locked (in id order) to the
/// transaction's end; those gone are missing.
pub async fn lock_candidates(
    tx: &mut PgConnection,
    ids: &[&String],
) -> Result<Vec<NodeCandidate>, sqlx::Error> {
    let nodes = "SELECT * FROM nodes WHERE id = ANY($1) ORDER BY id FOR UPDATE";
    let rows = sqlx::query(&booked(nodes))
        .bind(ids)
        .fetch_all(&mut *tx)
        .await?;
    Ok(rows.iter().map(|r| candidate(r, 0)).collect())
}

/// The nodes `nodes` selects, each with what its allocations book (summed on its row by the
/// projectors; GPUs summed per model from their allocations). A node's CPU model is one of its
/// labels (`cpu.model`), which a memory restore requires.
///
/// The GPU sum runs only for a node that has a GPU allocation (an index probe of the partial
/// index): its sort and aggregate cost 0.02 ms a node even with nothing to sum, 1.5 ms of a
/// 64-node read.
fn booked(nodes: &str) -> String {
    format!(
        "SELECT n.id, n.state, n.runtimes,
                n.labels || CASE WHEN n.cpu_model IS NULL THEN '{{}}'::jsonb
                                 ELSE jsonb_build_object('cpu.model', n.cpu_model) END,
                n.capacity, n.booked_vcpu, n.booked_memory_gib, n.booked_disk_gib,
                CASE WHEN EXISTS (SELECT 1 FROM node_allocations a
                                   WHERE a.node_id = n.id AND a.gpus > 0)
                     THEN (SELECT jsonb_object_agg(g.model, g.gpus)
                             FROM (SELECT a.gpu_model AS model, sum(a.gpus)::bigint AS gpus
                                     FROM node_allocations a
                                    WHERE a.node_id = n.id AND a.gpus > 0
                                    GROUP BY a.gpu_model) g)
                     ELSE '{{}}' END
           FROM ({nodes}) n"
    )
}

/// The node whose columns start at `at` of `r`.
fn candidate(r: &PgRow, at: usize) -> NodeCandidate {
    let Json(runtimes): Json<Vec<String>> = r.get(at + 2);
    let Json(labels): Json<BTreeMap<String, String>> = r.get(at + 3);
    let Json(capacity): Json<Capacity> = r.get(at + 4);
    let Json(gpus): Json<BTreeMap<String, i64>> = r.get(at + 8);
    NodeCandidate {
        id: r.get(at),
        state: match r.get::<String, _>(at + 1).as_str() {
            "ready" => NodeState::Ready,
            "unreachable" => NodeState::Unreachable,
            "lost" => NodeState::Lost,
            _ => NodeState::Cordoned,
        },
        runtimes,
        labels,
        capacity,
        allocated: Capacity {
            vcpu: r.get::<i64, _>(at + 5) as u32,
            memory_gib: r.get::<i64, _>(at + 6) as u32,
            disk_gib: r.get::<i64, _>(at + 7) as u32,
            gpus: gpus
                .into_iter()
                .map(|(model, count)| Gpus {
                    model,
                    count: count as u32,
                })
                .collect(),
        },
    }
}

/// Up to `limit` free addresses of the pool other than `claimed` (those this transaction
/// already holds: a lock does not hide a row from its own holder), each locked to this
/// transaction's end; waits for one only when every free row is held.
///
/// Concurrent claims skip each other's locked rows, so creates in one pool never queue behind
/// one another (SPEC §3.1: any free address may be chosen); the projector removes the row from
/// the free list when the lease is booked. Only when every free row is locked does a claim
/// wait: those claims may yet roll back (a refused create), so "no unlocked row" is not "no
/// free address".
///
/// Only an address freed by an older transaction is claimed: the log orders events by
/// transaction id, and a lease ordered before its address's release would not replay (see
/// the migration that adds `ip_free.freed_by`).
pub async fn free_addresses(
    tx: &mut PgConnection,
    pool_id: &str,
    limit: i64,
    claimed: &[String],
) -> Result<Vec<Ipv4Addr>, sqlx::Error> {
    for (claim, limit) in [("FOR UPDATE SKIP LOCKED", limit), ("FOR UPDATE", 1)] {
        let found: Vec<String> = sqlx::query_scalar(&claimable("$3", "$2", claim))
            .bind(pool_id)
            .bind(limit)
            .bind(claimed)
            .fetch_all(&mut *tx)
            .await?;
        if !found.is_empty() {
            return Ok(found.iter().filter_map(|a| a.parse().ok()).collect());
        }
    }
    Ok(Vec::new())
}

/// The free addresses of pool `$1` this transaction may claim, other than those of parameter
/// `held`, at most parameter `limit` in address order, locked by `claim`. Only an address
/// freed by an older transaction (see [`free_addresses`]): the one place that rule is
/// written, for a batch's first read and for the claims after it.
fn claimable(held: &str, limit: &str, claim: &str) -> String {
    format!(
        "SELECT address FROM ip_free WHERE pool_id = $1 AND NOT (address = ANY({held}))
            AND coalesce(freed_by < pg_current_xact_id_if_assigned(), true)
          ORDER BY address LIMIT {limit} {claim}"
    )
}
