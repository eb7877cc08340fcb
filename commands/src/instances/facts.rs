//! What instance decisions read: admission's facts in one place, the pool's nodes with their
//! bookings, a free address, and the confirmations that run after the append (the chosen node
//! still holds every booking, the charged quota still fits). The reads themselves live with
//! their tables (`vps_projections::instances::admission` and the table modules); what is
//! decided on them lives here.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use sqlx::PgConnection;
use vps_domain::instance::{AdmissionFacts, AdmissionPool, Instance, ResizeFacts};
use vps_domain::placement::NodeCandidate;
use vps_domain::quota::{check, Amounts, Delta};
use vps_domain::resources::Shape;
use vps_domain::DomainError;
use vps_projections::instances::admission::{self, CreateRead};

use super::CreateInput;
use crate::error::CommandError;

/// What a create names, as it stands (see [`admission::CreateFacts`]).
pub(crate) use vps_projections::instances::admission::CreateFacts;

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
    let read = CreateRead {
        pool_id: &input.pool_id,
        tenant_id: &input.tenant_id,
        flavor: &input.flavor,
        image_id: &input.image_id,
        nodes: reads.nodes,
        addresses: reads.addresses,
        held: reads.held,
        instances: reads.instances,
    };
    Ok(admission::create_facts(tx, &read).await?)
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
        Some(node_id) => admission::candidates(tx, &instance.pool_id, Some(node_id))
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
        nodes: admission::candidates(tx, pool_id, None).await?,
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
    Ok(admission::pool(tx, pool_id).await?)
}

/// The shape of a pool's flavor that is not archived.
pub async fn flavor_shape(
    tx: &mut PgConnection,
    pool_id: &str,
    flavor: &str,
) -> Result<Option<Shape>, CommandError> {
    Ok(vps_projections::flavors::shape(tx, pool_id, flavor).await?)
}

/// A tenant's quota maxima and usage in a pool.
pub(crate) async fn quota(
    tx: &mut PgConnection,
    pool_id: &str,
    tenant_id: &str,
) -> Result<(Amounts, Amounts), CommandError> {
    Ok(vps_projections::pools::quota(tx, pool_id, tenant_id).await?)
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
    let (max, charged) = vps_projections::pools::amounts(rows);
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
    let node = admission::candidates(tx, &instance.pool_id, Some(node_id)).await?;
    if node.first().is_some_and(|n| n.capacity.holds(&n.allocated)) {
        Ok(())
    } else {
        Err(CommandError::Raced(format!(
            "node {node_id} filled up meanwhile"
        )))
    }
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
    let rows = admission::lock_candidates(tx, &ids).await?;
    if rows.len() < ids.len() {
        return Err(CommandError::Raced("a booked node is gone".into()));
    }
    for node in rows {
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
    Ok(vps_projections::nodes::lock(tx, node_ids).await?)
}

/// Locks an instance's row to this transaction's end, before its stream is appended to (the
/// order host reports and liveness use: rows, then streams, so they never deadlock), and
/// answers the instance as the locked row holds it (`None`: no such instance).
pub async fn lock_instance(
    tx: &mut PgConnection,
    instance_id: &str,
) -> Result<Option<Instance>, CommandError> {
    Ok(vps_projections::instances::reads::lock(tx, instance_id).await?)
}

/// A free address of the pool's range, locked to this transaction's end; `None` when the
/// range is full. How claims skip each other, and which addresses they may take:
/// [`admission::free_addresses`].
async fn free_address(
    tx: &mut PgConnection,
    pool_id: &str,
) -> Result<Option<Ipv4Addr>, CommandError> {
    Ok(admission::free_addresses(tx, pool_id, 1, &[])
        .await?
        .into_iter()
        .next())
}
