//! What instance decisions read: admission's facts in one place, the pool's nodes with their
//! bookings, a free address, and the confirmations that run after the append (the chosen node
//! still holds every booking, the charged quota still fits).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::instance::{AdmissionFacts, AdmissionPool, Instance, PoolKind, ResizeFacts};
use vps_domain::placement::{NodeCandidate, NodeState};
use vps_domain::quota::{check, Amounts, Delta};
use vps_domain::resources::{Capacity, Gpus, QuotaResource, Shape};
use vps_domain::DomainError;

use super::CreateInput;
use crate::error::CommandError;

/// What a create names, as it stands: the pool (when offered to the tenant), the flavor's
/// shape, whether the image is the tenant's to use, and the tenant's quota in the pool; with
/// [`PoolReads`], also the pool's nodes and a run of its free addresses.
pub(crate) struct CreateFacts {
    pub pool: Option<AdmissionPool>,
    pub shape: Option<Shape>,
    /// The image, when the tenant may use it: whether it is verified.
    pub image: Option<bool>,
    pub quota: (Amounts, Amounts),
    pub nodes: Vec<NodeCandidate>,
    pub addresses: Vec<Ipv4Addr>,
    /// The instances of [`PoolReads::instances`] that exist.
    pub existing: Vec<Instance>,
}

/// What a create's read takes besides the facts, so a batch's first create reads everything
/// in one round trip: the pool's nodes with their bookings, up to `addresses` free addresses
/// other than `held` (each locked to the transaction's end, see [`free_address`]), and the
/// instances of ids `instances` (replays and conflicts).
#[derive(Clone, Copy)]
pub(crate) struct PoolReads<'a> {
    pub nodes: bool,
    pub addresses: i64,
    pub held: &'a [String],
    pub instances: &'a [String],
}

impl PoolReads<'_> {
    /// The facts alone.
    pub const NONE: PoolReads<'static> = PoolReads {
        nodes: false,
        addresses: 0,
        held: &[],
        instances: &[],
    };
}

/// Reads [`CreateFacts`] in one statement: one row per node read (or one row without a node).
pub(crate) async fn create_facts(
    tx: &mut PgConnection,
    input: &CreateInput,
    reads: PoolReads<'_>,
) -> Result<CreateFacts, CommandError> {
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
    .bind(&input.pool_id)
    .bind(&input.tenant_id)
    .bind(&input.flavor)
    .bind(&input.image_id)
    .bind(reads.addresses)
    .bind(reads.held)
    .bind(reads.nodes)
    .bind(reads.instances)
    .fetch_all(&mut *tx)
    .await?;
    let row = rows.first().ok_or_else(|| sqlx::Error::RowNotFound)?;
    let offered: bool = row.get(4);
    let pool = row
        .get::<Option<String>, _>(0)
        .filter(|_| offered)
        .and_then(|class| admission_pool(&class, row.get(1), row.get(2), row.get(3)));
    let Json(quota_rows): Json<Vec<(String, i64, i64)>> = row.get(7);
    let Json(existing): Json<Vec<Instance>> = row.get(8);
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

/// Quota rows `(resource, max, used)` as maxima and usage.
fn amounts(rows: Vec<(String, i64, i64)>) -> (Amounts, Amounts) {
    let (mut max, mut used) = (Amounts::new(), Amounts::new());
    for (resource, m, u) in rows {
        if let Some(resource) = QuotaResource::parse(&resource) {
            max.insert(resource, m.max(0) as u64);
            used.insert(resource, u.max(0) as u64);
        }
    }
    (max, used)
}

/// A pool row as admission sees it; `None` for a class admission does not know.
pub(crate) fn admission_pool(
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

/// What a resize of `instance` to `flavor` decides on. The node's row is locked to commit, so
/// a concurrent placement cannot take the room the resize counts on.
pub async fn resize(
    tx: &mut PgConnection,
    instance: &Instance,
    flavor: &str,
) -> Result<ResizeFacts, CommandError> {
    let (quota_max, quota_used) = quota(tx, &instance.pool_id, &instance.tenant_id).await?;
    let node = match &instance.node_id {
        Some(node_id) => candidates(tx, &instance.pool_id, Some(node_id))
            .await?
            .into_iter()
            .next()
            .map(|n| (n.capacity, n.allocated)),
        None => None,
    };
    Ok(ResizeFacts {
        shape: flavor_shape(tx, &instance.pool_id, flavor).await?,
        quota_max,
        quota_used,
        node,
    })
}

/// The facts a scheduling instance is placed on: its pool, nodes and a free address.
pub async fn placement(
    tx: &mut PgConnection,
    pool_id: &str,
) -> Result<(AdmissionPool, AdmissionFacts), CommandError> {
    let pool = pool(tx, pool_id)
        .await?
        .ok_or_else(|| DomainError::NotFound {
            what: format!("pool {pool_id}"),
        })?;
    let facts = AdmissionFacts {
        nodes: candidates(tx, pool_id, None).await?,
        free_address: match pool.has_range {
            true => free_address(tx, pool_id).await?,
            false => None,
        },
        ..AdmissionFacts::default()
    };
    Ok((pool, facts))
}

/// A pool as admission sees it.
async fn pool(tx: &mut PgConnection, pool_id: &str) -> Result<Option<AdmissionPool>, CommandError> {
    let row = sqlx::query(
        "SELECT class, runtime, provider_account_id IS NOT NULL, ip_cidr IS NOT NULL
           FROM pools WHERE id = $1",
    )
    .bind(pool_id)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(row.and_then(|r| admission_pool(&r.get::<String, _>(0), r.get(1), r.get(2), r.get(3))))
}

/// The shape of a pool's flavor that is not archived.
pub async fn flavor_shape(
    tx: &mut PgConnection,
    pool_id: &str,
    flavor: &str,
) -> Result<Option<Shape>, CommandError> {
    let shape: Option<Json<Shape>> = sqlx::query_scalar(
        "SELECT shape FROM flavors WHERE pool_id = $1 AND name = $2 AND NOT archived",
    )
    .bind(pool_id)
    .bind(flavor)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(shape.map(|Json(s)| s))
}

/// A tenant's quota maxima and usage in a pool.
pub(crate) async fn quota(
    tx: &mut PgConnection,
    pool_id: &str,
    tenant_id: &str,
) -> Result<(Amounts, Amounts), CommandError> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT resource, max, used FROM quotas WHERE pool_id = $1 AND tenant_id = $2",
    )
    .bind(pool_id)
    .bind(tenant_id)
    .fetch_all(&mut *tx)
    .await?;
    Ok(amounts(rows))
}

/// Checks that the quota still fits once this transaction's charge `delta` is in it. The
/// projector's update holds the quota rows locked, so concurrent charges queue here and the
/// check is exact: usage read now includes every committed charge and this one.
pub async fn confirm_quota(
    tx: &mut PgConnection,
    pool_id: &str,
    tenant_id: &str,
    delta: &Delta,
) -> Result<(), CommandError> {
    let (max, charged) = quota(tx, pool_id, tenant_id).await?;
    fits_after(&max, &charged, delta)
}

/// [`confirm_quota`] on rows `(resource, max, used)` the charge's own statement answered.
pub(crate) fn check_charged(
    rows: Vec<(String, i64, i64)>,
    delta: &Delta,
) -> Result<(), CommandError> {
    let (max, charged) = amounts(rows);
    fits_after(&max, &charged, delta)
}

/// Whether usage `charged`, which includes `delta`, fits `max`: the usage before the charge,
/// with the charge on top.
fn fits_after(max: &Amounts, charged: &Amounts, delta: &Delta) -> Result<(), CommandError> {
    let before: Amounts = charged
        .iter()
        .map(|(r, used)| {
            let charge = delta.get(r).copied().unwrap_or(0);
            (*r, (*used as i64 - charge).max(0) as u64)
        })
        .collect();
    check(max, &before, delta)?;
    Ok(())
}

/// Checks, holding the node's lock until commit, that the node an instance was just placed on
/// still holds every booking (its own included). When a concurrent placement took the room
/// first, the transaction must be decided again.
pub async fn confirm_placement(
    tx: &mut PgConnection,
    instance: &Instance,
) -> Result<(), CommandError> {
    let Some(node_id) = &instance.node_id else {
        return Ok(());
    };
    let node = candidates(tx, &instance.pool_id, Some(node_id)).await?;
    if node.first().is_some_and(|n| n.capacity.holds(&n.allocated)) {
        Ok(())
    } else {
        Err(CommandError::Raced(format!(
            "node {node_id} filled up meanwhile"
        )))
    }
}

/// The pool's nodes with what is booked on them; with `lock`, only that node, locked.
pub async fn candidates(
    tx: &mut PgConnection,
    pool_id: &str,
    lock: Option<&str>,
) -> Result<Vec<NodeCandidate>, CommandError> {
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

/// Locks the nodes of `bookings` (in id order, to this transaction's end) and checks that each
/// holds what is booked on it with the shapes listed for it on top. Before the bookings are
/// written, so one round trip locks and checks: while the rows are locked nobody else books
/// them, and what the write will add is exactly the shapes listed.
pub async fn confirm_bookings(
    tx: &mut PgConnection,
    bookings: &BTreeMap<String, Vec<&Shape>>,
) -> Result<(), CommandError> {
    confirm_bookings_seen(tx, bookings, &[]).await
}

/// [`confirm_bookings`] for placements decided on `seen`, node rows read before this
/// transaction (the admitter keeps them between batches): each locked node must also still be
/// what placement saw of it (state, runtimes, labels, capacity), or the batch raced a change.
pub(crate) async fn confirm_bookings_seen(
    tx: &mut PgConnection,
    bookings: &BTreeMap<String, Vec<&Shape>>,
    seen: &[&NodeCandidate],
) -> Result<(), CommandError> {
    if bookings.is_empty() {
        return Ok(());
    }
    let ids: Vec<&String> = bookings.keys().collect();
    let nodes = "SELECT * FROM nodes WHERE id = ANY($1) ORDER BY id FOR UPDATE";
    let rows = sqlx::query(&booked(nodes))
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
    if rows.len() < ids.len() {
        return Err(CommandError::Raced("a booked node is gone".into()));
    }
    for node in rows.iter().map(|r| candidate(r, 0)) {
        if let Some(was) = seen.iter().find(|n| n.id == node.id) {
            let same = (&was.state, &was.runtimes, &was.labels, &was.capacity)
                == (&node.state, &node.runtimes, &node.labels, &node.capacity);
            if !same {
                return Err(CommandError::Raced(format!(
                    "node {} changed since it was read",
                    node.id
                )));
            }
        }
        let shapes = bookings.get(&node.id).map(Vec::as_slice).unwrap_or(&[]);
        let after = shapes.iter().fold(node.allocated.clone(), |a, s| a.plus(s));
        if !node.capacity.holds(&after) {
            return Err(CommandError::Raced(format!(
                "node {} filled up meanwhile",
                node.id
            )));
        }
    }
    Ok(())
}

/// Locks `node_ids` (in id order) to this transaction's end. A resize takes it before the
/// instance's row, the order host reports use too.
pub async fn lock_nodes(tx: &mut PgConnection, node_ids: &[String]) -> Result<(), CommandError> {
    if !node_ids.is_empty() {
        sqlx::query("SELECT id FROM nodes WHERE id = ANY($1) ORDER BY id FOR UPDATE")
            .bind(node_ids)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// Locks an instance's row to this transaction's end, before its stream is appended to (the
/// order host reports and liveness use: rows, then streams, so they never deadlock), and
/// answers the instance as the locked row holds it (`None`: no such instance).
pub async fn lock_instance(
    tx: &mut PgConnection,
    instance_id: &str,
) -> Result<Option<Instance>, CommandError> {
    let row: Option<sqlx::types::Json<Instance>> =
        sqlx::query_scalar("SELECT doc FROM instances WHERE id = $1 FOR UPDATE")
            .bind(instance_id)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(row.map(|doc| doc.0))
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
fn candidate(r: &sqlx::postgres::PgRow, at: usize) -> NodeCandidate {
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

/// A free address of the pool's range, locked to this transaction's end; `None` when the
/// range is full. Concurrent claims skip each other's locked rows, so creates in one pool never
/// queue behind one another (SPEC §3.1: any free address may be chosen); the projector removes
/// the row from the free list when the lease is booked.
///
/// Only when every free row is locked does a claim wait: those claims may yet roll back (a
/// refused create), so "no unlocked row" is not "no free address".
///
/// Only an address freed by an older transaction is claimed: the log orders events by
/// transaction id, and a lease ordered before its address's release would not replay (see
/// the migration that adds `ip_free.freed_by`).
async fn free_address(
    tx: &mut PgConnection,
    pool_id: &str,
) -> Result<Option<Ipv4Addr>, CommandError> {
    Ok(free_addresses(tx, pool_id, 1, &[])
        .await?
        .into_iter()
        .next())
}

/// Up to `limit` free addresses of the pool other than `claimed` (those this transaction
/// already holds: a lock does not hide a row from its own holder), each locked to this
/// transaction's end (see [`free_address`]); waits for one only when every free row is held.
pub(super) async fn free_addresses(
    tx: &mut PgConnection,
    pool_id: &str,
    limit: i64,
    claimed: &[String],
) -> Result<Vec<Ipv4Addr>, CommandError> {
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
/// freed by an older transaction (see [`free_address`]): the one place that rule is written,
/// for a batch's first read and for the claims after it.
fn claimable(held: &str, limit: &str, claim: &str) -> String {
    format!(
        "SELECT address FROM ip_free WHERE pool_id = $1 AND NOT (address = ANY({held}))
            AND coalesce(freed_by < pg_current_xact_id_if_assigned(), true)
          ORDER BY address LIMIT {limit} {claim}"
    )
}

/// An instance's `state` column read back as the domain's state; a value the domain does not
/// know reads as `error`, so it is never taken for a settled state.
pub(crate) fn state_column(state: String) -> vps_domain::state_table::InstanceState {
    serde_json::from_value(serde_json::Value::String(state))
        .unwrap_or(vps_domain::state_table::InstanceState::Error)
}
