//! Instance views, and what instances hold: quota usage, node allocations and IP leases.
//!
//! One projector for all four because they move together: the view's stored state says what
//! an event releases (the shape to refund, the allocation to drop). NodeSpecs follow from these
//! views asynchronously (`node_specs`), off the commands' path.

use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::instance::{evolve, Instance, InstanceEvent};
use vps_domain::quota::{charge_of, resize_delta, Delta};
use vps_domain::resources::Shape;
use vps_events::RecordedEvent;

use crate::instance_doc::{self, InstanceDoc};
use crate::{bookings, ProjectionError};

pub mod admission;
pub(crate) mod batch;
pub mod reads;

/// Applies one `instance.*` event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    apply_run(conn, std::slice::from_ref(e), None).await
}

/// Applies consecutive events of one instance's stream: the view is read once, each event's
/// side effects (quota, allocation, lease) applied in turn, and the view stored once. `prior`:
/// the instance the appending command decided on ([`crate::Prior`]).
pub async fn apply_run(
    conn: &mut PgConnection,
    run: &[RecordedEvent],
    prior: Option<&Instance>,
) -> Result<(), ProjectionError> {
    let mut state: Option<Option<Instance>> = None;
    let mut last = None;
    for e in run {
        let event = InstanceEvent::from_parts(&e.event_type, e.data.clone())
            .map_err(|err| malformed(e, err))?;
        let before = match state.take() {
            Some(s) => s,
            None => match crate::known_before(e, prior, |i: &Instance| &i.id) {
                Ok(known) => known,
                Err(()) => load(conn, event.instance_id()).await?,
            },
        };
        let after =
            evolve(before.clone(), &event, e.recorded_at).map_err(|err| malformed(e, err))?;
        side_effects(conn, &event, before.as_ref(), &after).await?;
        state = Some(Some(after.clone()));
        last = Some(after);
    }
    match last {
        Some(after) => store(conn, &after).await,
        None => Ok(()),
    }
}

fn malformed(e: &RecordedEvent, err: impl std::fmt::Display) -> ProjectionError {
    ProjectionError::Malformed {
        event_id: e.id.clone(),
        event_type: e.event_type.clone(),
        message: err.to_string(),
    }
}

/// What an event does besides changing the view.
async fn side_effects(
    conn: &mut PgConnection,
    event: &InstanceEvent,
    before: Option<&Instance>,
    after: &Instance,
) -> Result<(), ProjectionError> {
    match event {
        InstanceEvent::Created(_) => charge(conn, after, &charge_of(&after.shape), 1).await?,
        InstanceEvent::Scheduled(s) => {
            let insert = concat!(
                "INSERT INTO node_allocations (id, node_id, instance_id, vcpu, memory_gib, disk_gib, gpu_model, gpus)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                bookings::returning!()
            );
            sqlx::query(&bookings::booking(insert, false))
                .bind(&s.allocation_id)
                .bind(&s.node_id)
                .bind(&after.id)
                .bind(after.shape.vcpu as i64)
                .bind(after.shape.memory_gib as i64)
                .bind(after.shape.disk_gib as i64)
                .bind(after.shape.gpus.as_ref().map(|g| g.model.clone()))
                .bind(
                    after
                        .shape
                        .gpus
                        .as_ref()
                        .map(|g| g.count as i64)
                        .unwrap_or(0),
                )
                .execute(&mut *conn)
                .await?;
            // The lease leaves the free list in the same statement.
            sqlx::query(
                "WITH claimed AS (DELETE FROM ip_free WHERE pool_id = $1 AND address = $2)
                 INSERT INTO ip_leases (pool_id, address, instance_id) VALUES ($1, $2, $3)",
            )
            .bind(&after.pool_id)
            .bind(&s.address)
            .bind(&after.id)
            .execute(&mut *conn)
            .await?;
        }
        InstanceEvent::Resized(r) => {
            charge(conn, after, &resize_delta(&r.previous_shape, &r.shape), 1).await?;
            resize_allocation(conn, &after.id, &r.shape).await?;
        }
        InstanceEvent::Recreating(_) => release_placement(conn, &after.id).await?,
        InstanceEvent::Deleted(_) => {
            release_placement(conn, &after.id).await?;
            let shape = before.map(|b| &b.shape).unwrap_or(&after.shape);
            charge(conn, after, &charge_of(shape), -1).await?;
        }
        _ => {}
    }
    Ok(())
}

/// The stored view of an instance (the projection doubles as the aggregate's snapshot).
pub async fn load(conn: &mut PgConnection, id: &str) -> Result<Option<Instance>, ProjectionError> {
    let doc = crate::sandboxes::load_doc::<InstanceDoc>(conn, "instances", id).await?;
    Ok(doc.map(Instance::from))
}

/// What `instances.list` selects: a tenant's instances (not warm ones), newest first.
#[derive(Debug, Clone, Default)]
pub struct InstanceFilter {
    /// The tenant.
    pub tenant_id: String,
    /// Only those this identity created.
    pub owner: Option<String>,
    /// Only in this state.
    pub state: Option<String>,
    /// Only in this pool.
    pub pool_id: Option<String>,
    /// Only older than this (created at, id): the previous page's last item.
    pub before: Option<(chrono::DateTime<chrono::Utc>, String)>,
    /// Only those carrying every one of these labels.
    pub labels: vps_domain::labels::Labels,
}

/// Up to `limit` instances matching `filter`, newest first. Only the filter's conditions are
/// in the statement (one prepared statement per combination), so each one's plan can walk the
/// index that serves it instead of one generic plan for all.
pub async fn page<'e>(
    db: impl sqlx::PgExecutor<'e>,
    filter: &InstanceFilter,
    limit: i64,
) -> Result<Vec<Instance>, ProjectionError> {
    let ids_first = !filter.labels.is_empty();
    let mut q = crate::pages::open("instances", ids_first);
    q.push("tenant_id = ")
        .push_bind(&filter.tenant_id)
        .push(" AND NOT warm");
    if let Some(owner) = &filter.owner {
        q.push(" AND owner_identity_id = ").push_bind(owner);
    }
    if let Some(state) = &filter.state {
        q.push(" AND state = ").push_bind(state);
    }
    if let Some(pool_id) = &filter.pool_id {
        q.push(" AND pool_id = ").push_bind(pool_id);
    }
    if !filter.labels.is_empty() {
        q.push(" AND labels @> ").push_bind(Json(&filter.labels));
    }
    if let Some((at, id)) = &filter.before {
        q.push(" AND (created_at, id) < (").push_bind(at);
        q.push(", ").push_bind(id).push(")");
    }
    crate::pages::close(&mut q, "instances", ids_first, limit);
    let rows: Vec<Json<InstanceDoc>> = q.build_query_scalar().fetch_all(db).await?;
    Ok(rows.into_iter().map(instance_doc::instance).collect())
}

/// A tenant's newest `limit` instance documents, by the listing index alone: what a list's
/// speed is measured against (`vps bench list`).
pub async fn newest_docs<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant_id: &str,
    limit: i64,
) -> Result<Vec<Json<serde_json::Value>>, ProjectionError> {
    Ok(sqlx::query_scalar(
        "SELECT doc FROM instances WHERE tenant_id = $1
          ORDER BY created_at DESC, id DESC LIMIT $2",
    )
    .bind(tenant_id)
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// The stored views of the instances among `ids` that exist, by id.
pub async fn load_many(
    conn: &mut PgConnection,
    ids: &[String],
) -> Result<std::collections::HashMap<String, Instance>, ProjectionError> {
    let rows: Vec<Json<InstanceDoc>> =
        sqlx::query_scalar("SELECT doc FROM instances WHERE id = ANY($1)")
            .bind(ids)
            .fetch_all(conn)
            .await?;
    Ok(rows
        .into_iter()
        .map(instance_doc::instance)
        .map(|i| (i.id.clone(), i))
        .collect())
}

/// What storing a view changes of a row that exists: the columns an event can change (the
/// batched rebuild stores with the same clause).
macro_rules! store_conflict {
    () => {
        " ON CONFLICT (id) DO UPDATE SET state = excluded.state, desired_state = excluded.desired_state,
            node_id = excluded.node_id, doc = excluded.doc, updated_at = excluded.updated_at,
            version = excluded.version, owner_identity_id = excluded.owner_identity_id,
            warm = excluded.warm, warm_template_id = excluded.warm_template_id"
    };
}
use store_conflict;

async fn store(conn: &mut PgConnection, i: &Instance) -> Result<(), ProjectionError> {
    sqlx::query(concat!(
        "INSERT INTO instances (id, tenant_id, pool_id, state, desired_state, node_id,
                                owner_identity_id, warm, doc, created_at, updated_at, version,
                                warm_template_id, template_version)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        store_conflict!()
    ))
    .bind(&i.id)
    .bind(&i.tenant_id)
    .bind(&i.pool_id)
    .bind(i.state.as_str())
    .bind(i.desired_state.as_str())
    .bind(&i.node_id)
    .bind(&i.owner_identity_id)
    .bind(i.warm_template_id.is_some())
    .bind(instance_doc::stored(i))
    .bind(i.created_at)
    .bind(i.updated_at)
    .bind(i.version as i64)
    .bind(&i.warm_template_id)
    .bind(i.template_version.map(|v| v as i64))
    .execute(conn)
    .await?;
    Ok(())
}

/// Adds `sign * delta` to the tenant's usage in the instance's pool, in one statement.
async fn charge(
    conn: &mut PgConnection,
    i: &Instance,
    delta: &Delta,
    sign: i64,
) -> Result<(), ProjectionError> {
    charge_quota(conn, &i.pool_id, &i.tenant_id, delta, sign).await
}

/// Adds `sign * delta` to a tenant's usage in a pool, in one statement (instances and
/// volumes charge the same rows).
pub(crate) async fn charge_quota(
    conn: &mut PgConnection,
    pool_id: &str,
    tenant_id: &str,
    delta: &Delta,
    sign: i64,
) -> Result<(), ProjectionError> {
    let (resources, amounts): (Vec<&str>, Vec<i64>) = delta
        .iter()
        .filter(|(_, amount)| **amount != 0)
        .map(|(resource, amount)| (resource.as_str(), sign * amount))
        .unzip();
    if resources.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO quotas (pool_id, tenant_id, resource, used)
         SELECT $1, $2, r, a FROM unnest($3::text[], $4::bigint[]) AS u(r, a)
         ON CONFLICT (pool_id, tenant_id, resource) DO UPDATE SET used = quotas.used + excluded.used",
    )
    .bind(pool_id)
    .bind(tenant_id)
    .bind(&resources)
    .bind(&amounts)
    .execute(conn)
    .await?;
    Ok(())
}

async fn resize_allocation(
    conn: &mut PgConnection,
    instance_id: &str,
    shape: &Shape,
) -> Result<(), ProjectionError> {
    let update = concat!(
        "UPDATE node_allocations SET vcpu = $2, memory_gib = $3, disk_gib = $4 WHERE instance_id = $1",
        bookings::returning!()
    );
    sqlx::query(&bookings::rebooking(update, "instance_id"))
        .bind(instance_id)
        .bind(shape.vcpu as i64)
        .bind(shape.memory_gib as i64)
        .bind(shape.disk_gib as i64)
        .execute(conn)
        .await?;
    Ok(())
}

/// Whether the address `$t.address` of pool `p` (joined) is one the pool leases: a released
/// address goes back to the free list only then.
macro_rules! in_range {
    ($t:literal) => {
        concat!(
            "inet(",
            $t,
            ".address) << inet(p.ip_cidr) AND ",
            $t,
            ".address <> p.ip_gateway
             AND inet(",
            $t,
            ".address) <> network(inet(p.ip_cidr))
             AND inet(",
            $t,
            ".address) <> broadcast(inet(p.ip_cidr))"
        )
    };
}
use in_range;

async fn release_placement(
    conn: &mut PgConnection,
    instance_id: &str,
) -> Result<(), ProjectionError> {
    let delete = concat!(
        "DELETE FROM node_allocations WHERE instance_id = $1",
        bookings::returning!()
    );
    sqlx::query(&bookings::booking(delete, true))
        .bind(instance_id)
        .execute(&mut *conn)
        .await?;
    // A released address goes back to the free list (when still in the pool's range).
    sqlx::query(concat!(
        "WITH gone AS (DELETE FROM ip_leases WHERE instance_id = $1 RETURNING pool_id, address)
         INSERT INTO ip_free (pool_id, address)
         SELECT g.pool_id, g.address FROM gone g JOIN pools p ON p.id = g.pool_id
          WHERE ",
        in_range!("g"),
        " ON CONFLICT DO NOTHING"
    ))
    .bind(instance_id)
    .execute(conn)
    .await?;
    Ok(())
}

/// Applies the events of instances that did not exist before (batch admission's creates, each
/// `instance.created` and possibly its placement) with one statement per table for the whole
/// batch. The rows are the ones [`apply_run`] would write event by event; a run with any other
/// side effect goes through [`apply_run`].
///
/// Answers the quota rows the one statement charged, as they stand after the charge (locked
/// to the transaction's end), so the caller confirms its quota without reading them again.
pub async fn apply_new(
    conn: &mut PgConnection,
    runs: &[&[RecordedEvent]],
) -> Result<Vec<ChargedQuota>, ProjectionError> {
    let mut rows = NewRows::default();
    for run in runs {
        match fold_new(run)? {
            Some((instance, placement)) => rows.add(instance, placement),
            None => apply_run(conn, run, None).await?,
        }
    }
    rows.write(conn).await
}

/// A quota row after a charge: `(pool_id, tenant_id, resource, max, used)`.
pub type ChargedQuota = (String, String, String, i64, i64);

/// A placement's allocation id and address.
type Placement = (String, String);

/// A new instance's run folded in memory, with its placement (allocation id, address); `None`
/// when an event of the run has side effects beyond a create and a placement.
fn fold_new(
    run: &[RecordedEvent],
) -> Result<Option<(Instance, Option<Placement>)>, ProjectionError> {
    let mut state: Option<Instance> = None;
    let mut placement = None;
    for e in run {
        let event = InstanceEvent::from_parts(&e.event_type, e.data.clone())
            .map_err(|err| malformed(e, err))?;
        match &event {
            InstanceEvent::Created(_) if state.is_none() => {}
            InstanceEvent::Scheduled(s) => {
                placement = Some((s.allocation_id.clone(), s.address.clone()))
            }
            InstanceEvent::Created(_)
            | InstanceEvent::Resized(_)
            | InstanceEvent::Recreating(_)
            | InstanceEvent::Deleted(_) => return Ok(None),
            _ => {}
        }
        state = Some(evolve(state, &event, e.recorded_at).map_err(|err| malformed(e, err))?);
    }
    Ok(state.map(|i| (i, placement)))
}

/// The rows a batch of new instances adds, gathered for one statement per table.
#[derive(Default)]
struct NewRows {
    instances: Vec<Instance>,
    allocations: Vec<(String, Instance)>,
    leases: Vec<(String, String, String)>,
    charges: std::collections::BTreeMap<(String, String, &'static str), i64>,
}

impl NewRows {
    fn add(&mut self, instance: Instance, placement: Option<Placement>) {
        for (resource, amount) in charge_of(&instance.shape) {
            let key = (
                instance.pool_id.clone(),
                instance.tenant_id.clone(),
                resource.as_str(),
            );
            *self.charges.entry(key).or_insert(0) += amount;
        }
        if let Some((allocation_id, address)) = placement {
            self.leases
                .push((instance.pool_id.clone(), address, instance.id.clone()));
            self.allocations.push((allocation_id, instance.clone()));
        }
        self.instances.push(instance);
    }

    /// Writes every row in one statement: views, allocations, leases (each taking its address
    /// off the free list) and the summed quota charges, so a batch costs one round trip.
    async fn write(self, conn: &mut PgConnection) -> Result<Vec<ChargedQuota>, ProjectionError> {
        if self.instances.is_empty() {
            return Ok(Vec::new());
        }
        let all = &self.instances;
        let text = |f: fn(&Instance) -> String| all.iter().map(f).collect::<Vec<_>>();
        let query = sqlx::query(NEW_ROWS)
            .bind(text(|i| i.id.clone()))
            .bind(text(|i| i.tenant_id.clone()))
            .bind(text(|i| i.pool_id.clone()))
            .bind(text(|i| i.state.as_str().to_string()))
            .bind(text(|i| i.desired_state.as_str().to_string()))
            .bind(all.iter().map(|i| i.node_id.clone()).collect::<Vec<_>>())
            .bind(text(|i| i.owner_identity_id.clone()))
            .bind(
                all.iter()
                    .map(|i| i.warm_template_id.is_some())
                    .collect::<Vec<_>>(),
            )
            .bind(all.iter().map(instance_doc::stored).collect::<Vec<_>>())
            .bind(all.iter().map(|i| i.created_at).collect::<Vec<_>>())
            .bind(all.iter().map(|i| i.updated_at).collect::<Vec<_>>())
            .bind(all.iter().map(|i| i.version as i64).collect::<Vec<_>>());
        let charged = self.bind_placements(query).fetch_all(conn).await?;
        charged
            .iter()
            .map(|r| {
                Ok((
                    r.try_get(0)?,
                    r.try_get(1)?,
                    r.try_get(2)?,
                    r.try_get(3)?,
                    r.try_get(4)?,
                ))
            })
            .collect()
    }

    /// Binds the allocations, leases and quota charges ($13 to $27) after the views.
    fn bind_placements<'q>(
        &'q self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let allocations = &self.allocations;
        let shape = |f: fn(&Shape) -> i64| {
            allocations
                .iter()
                .map(|(_, i)| f(&i.shape))
                .collect::<Vec<_>>()
        };
        let charges: Vec<_> = self.charges.iter().filter(|(_, a)| **a != 0).collect();
        query
            .bind(
                allocations
                    .iter()
                    .map(|(a, _)| a.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(
                allocations
                    .iter()
                    .map(|(_, i)| i.node_id.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(
                allocations
                    .iter()
                    .map(|(_, i)| i.id.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(shape(|s| s.vcpu as i64))
            .bind(shape(|s| s.memory_gib as i64))
            .bind(shape(|s| s.disk_gib as i64))
            .bind(
                allocations
                    .iter()
                    .map(|(_, i)| i.shape.gpus.as_ref().map(|g| g.model.clone()))
                    .collect::<Vec<_>>(),
            )
            .bind(shape(|s| s.gpus.as_ref().map_or(0, |g| g.count as i64)))
            .bind(self.leases.iter().map(|l| l.0.clone()).collect::<Vec<_>>())
            .bind(self.leases.iter().map(|l| l.1.clone()).collect::<Vec<_>>())
            .bind(self.leases.iter().map(|l| l.2.clone()).collect::<Vec<_>>())
            .bind(
                charges
                    .iter()
                    .map(|((p, _, _), _)| p.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(
                charges
                    .iter()
                    .map(|((_, t, _), _)| t.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(
                charges
                    .iter()
                    .map(|((_, _, r), _)| r.to_string())
                    .collect::<Vec<_>>(),
            )
            .bind(charges.iter().map(|(_, a)| **a).collect::<Vec<_>>())
    }
}

/// The rows of a batch of new instances, one data-modifying CTE per table.
const NEW_ROWS: &str = concat!(
    "
WITH views AS (
    INSERT INTO instances (id, tenant_id, pool_id, state, desired_state, node_id,
                           owner_identity_id, warm, doc, created_at, updated_at, version)
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                         $7::text[], $8::bool[], $9::jsonb[], $10::timestamptz[],
                         $11::timestamptz[], $12::bigint[])
), allocations AS (
    INSERT INTO node_allocations (id, node_id, instance_id, vcpu, memory_gib, disk_gib, gpu_model, gpus)
    SELECT * FROM unnest($13::text[], $14::text[], $15::text[], $16::bigint[], $17::bigint[],
                         $18::bigint[], $19::text[], $20::bigint[])
    ",
    bookings::returning!(),
    "
), ",
    bookings::new_allocations!(),
    ", l AS (
    SELECT * FROM unnest($21::text[], $22::text[], $23::text[]) AS u(pool_id, address, instance_id)
), claimed AS (
    DELETE FROM ip_free f USING l WHERE f.pool_id = l.pool_id AND f.address = l.address
), leases AS (
    INSERT INTO ip_leases (pool_id, address, instance_id) SELECT pool_id, address, instance_id FROM l
)
INSERT INTO quotas (pool_id, tenant_id, resource, used)
SELECT * FROM unnest($24::text[], $25::text[], $26::text[], $27::bigint[])
ON CONFLICT (pool_id, tenant_id, resource) DO UPDATE SET used = quotas.used + excluded.used
RETURNING pool_id, tenant_id, resource, max, used"
);
