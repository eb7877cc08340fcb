//! The instance projector for many events at once (a replay): each event is folded in memory
//! with the same `evolve`, its side effects gathered, and a segment's rows written with one
//! statement per table. The rows are exactly those `apply_run` writes event by event, as long
//! as nothing else writes the tables in between: the caller flushes before any other
//! projector runs.
//!
//! Why the gathered effects equal the event-by-event ones:
//! - quota charges and node sums are additions (a charge row exists once any charge of it was
//!   non-zero, even if they sum to zero);
//! - an instance holds at most one allocation and one lease (`instance_id` is unique in both
//!   tables): what it held before the segment is released (by `instance_id`) before anything
//!   of the segment is written, which is the only order the unique keys allow;
//! - of an address claimed or released in the segment, the free list ends as its last change
//!   left it (a release outside the pool's range adds nothing, so then the last claim decides).

use std::collections::{BTreeMap, HashMap, HashSet};

use sqlx::PgConnection;
use vps_domain::instance::{evolve, Instance, InstanceEvent};
use vps_domain::quota::{charge_of, resize_delta, Delta};
use vps_domain::resources::Shape;
use vps_events::RecordedEvent;

use super::{in_range, instance_doc, malformed, resize_allocation, store_conflict};
use crate::{bookings, ProjectionError};

/// The instances folded so far and a segment's gathered writes.
#[derive(Default)]
pub(crate) struct Batch {
    /// Views as they stand after the events folded (flushed or not).
    views: HashMap<String, Instance>,
    /// Views changed since the last flush.
    dirty: Vec<String>,
    dirty_set: HashSet<String>,
    /// Instances created in this segment (nothing of theirs is stored yet).
    fresh: HashSet<String>,
    /// Instances whose allocation and lease from before the segment are released.
    released: Vec<String>,
    released_set: HashSet<String>,
    /// Allocations from before the segment resized in it (vcpu, memory, disk).
    resized: BTreeMap<String, Shape>,
    /// Allocations made in this segment, by instance.
    allocations: BTreeMap<String, Allocation>,
    /// Leases made in this segment: (pool, address) by instance.
    leases: BTreeMap<String, (String, String)>,
    leased: HashSet<(String, String)>,
    /// Addresses claimed or released in this segment: (last change was a claim, any claim).
    addresses: BTreeMap<(String, String), (bool, bool)>,
    /// Summed charges by (pool, tenant, resource); a key is here once any charge of it was
    /// non-zero (its row exists then, even when the charges sum to zero).
    charges: BTreeMap<(String, String, String), i64>,
}

struct Allocation {
    id: String,
    node_id: String,
    shape: Shape,
}

impl Batch {
    /// Folds one `instance.*` event, whose data is taken (the caller holds the event only for
    /// this fold). Needs the view of an instance not seen yet: `load` reads it (flushed rows
    /// only; the caller flushes first when in doubt).
    pub(crate) async fn fold(
        &mut self,
        conn: &mut PgConnection,
        e: &mut RecordedEvent,
    ) -> Result<(), ProjectionError> {
        let data = std::mem::take(&mut e.data);
        let event =
            InstanceEvent::from_parts(&e.event_type, data).map_err(|err| malformed(e, err))?;
        let e: &RecordedEvent = e;
        let id = event.instance_id().to_string();
        let before = if e.version == 1 {
            None
        } else if let Some(v) = self.views.remove(&id) {
            Some(v)
        } else {
            super::load(conn, &id).await?
        };
        // Only a delete reads the state before it (the shape to refund): no clone otherwise.
        let before_shape = match (&event, &before) {
            (InstanceEvent::Deleted(_), Some(b)) => Some(b.shape.clone()),
            _ => None,
        };
        let created = before.is_none();
        let after = evolve(before, &event, e.recorded_at).map_err(|err| malformed(e, err))?;
        self.side_effects(e, &event, created, before_shape.as_ref(), &after)?;
        if self.dirty_set.insert(after.id.clone()) {
            self.dirty.push(after.id.clone());
        }
        self.views.insert(after.id.clone(), after);
        Ok(())
    }

    /// Whether anything waits to be written.
    pub(crate) fn is_empty(&self) -> bool {
        self.dirty.is_empty()
    }

    /// `created`: there was no state before the event; `before_shape`: a delete's shape before
    /// it.
    fn side_effects(
        &mut self,
        e: &RecordedEvent,
        event: &InstanceEvent,
        created: bool,
        before_shape: Option<&Shape>,
        after: &Instance,
    ) -> Result<(), ProjectionError> {
        match event {
            InstanceEvent::Created(_) => {
                if created {
                    self.fresh.insert(after.id.clone());
                }
                self.charge(after, &charge_of(&after.shape), 1);
            }
            InstanceEvent::Scheduled(s) => {
                let key = (after.pool_id.clone(), s.address.clone());
                if self.allocations.contains_key(&after.id) || self.leased.contains(&key) {
                    return Err(malformed(e, "placed twice (allocation or address taken)"));
                }
                self.allocations.insert(
                    after.id.clone(),
                    Allocation {
                        id: s.allocation_id.clone(),
                        node_id: s.node_id.clone(),
                        shape: after.shape.clone(),
                    },
                );
                self.leases.insert(after.id.clone(), key.clone());
                self.leased.insert(key.clone());
                self.addresses.insert(key, (true, true));
            }
            InstanceEvent::Resized(r) => {
                self.charge(after, &resize_delta(&r.previous_shape, &r.shape), 1);
                if let Some(a) = self.allocations.get_mut(&after.id) {
                    a.shape.vcpu = r.shape.vcpu;
                    a.shape.memory_gib = r.shape.memory_gib;
                    a.shape.disk_gib = r.shape.disk_gib;
                } else if self.holds_from_before(&after.id) {
                    self.resized.insert(after.id.clone(), r.shape.clone());
                }
            }
            InstanceEvent::Recreating(_) => self.release(&after.id),
            InstanceEvent::Deleted(_) => {
                self.release(&after.id);
                let shape = before_shape.unwrap_or(&after.shape);
                self.charge(after, &charge_of(shape), -1);
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether what the instance held before the segment may still be stored.
    fn holds_from_before(&self, id: &str) -> bool {
        !self.fresh.contains(id) && !self.released_set.contains(id)
    }

    /// What `release_placement` does: the allocation and the lease go (the address back to
    /// the free list when in range).
    fn release(&mut self, id: &str) {
        let allocated = self.allocations.remove(id).is_some();
        let leased = self.leases.remove(id);
        if let Some(key) = &leased {
            self.leased.remove(key);
            let any_claim = self.addresses.get(key).is_some_and(|a| a.1);
            self.addresses.insert(key.clone(), (false, any_claim));
        }
        if !allocated && leased.is_none() && self.holds_from_before(id) {
            self.resized.remove(id);
            self.released.push(id.to_string());
            self.released_set.insert(id.to_string());
        }
    }

    fn charge(&mut self, i: &Instance, delta: &Delta, sign: i64) {
        for (resource, amount) in delta.iter().filter(|(_, a)| **a != 0) {
            let key = (
                i.pool_id.clone(),
                i.tenant_id.clone(),
                resource.as_str().to_string(),
            );
            *self.charges.entry(key).or_insert(0) += sign * amount;
        }
    }

    /// Writes the segment: releases of what instances held before it, resizes of it, the
    /// free list's changes, new allocations and leases, charges, and the views. Views of
    /// deleted instances are then forgotten (read back if an event still comes).
    pub(crate) async fn flush(&mut self, conn: &mut PgConnection) -> Result<(), ProjectionError> {
        if !self.released.is_empty() {
            let delete = concat!(
                "DELETE FROM node_allocations WHERE instance_id = ANY($1)",
                bookings::returning!()
            );
            sqlx::query(&bookings::booking(delete, true))
                .bind(&self.released)
                .execute(&mut *conn)
                .await?;
            sqlx::query(concat!(
                "WITH gone AS (DELETE FROM ip_leases WHERE instance_id = ANY($1)
                               RETURNING pool_id, address)
                 INSERT INTO ip_free (pool_id, address)
                 SELECT g.pool_id, g.address FROM gone g JOIN pools p ON p.id = g.pool_id
                  WHERE ",
                in_range!("g"),
                " ON CONFLICT DO NOTHING"
            ))
            .bind(&self.released)
            .execute(&mut *conn)
            .await?;
        }
        for (id, shape) in &self.resized {
            resize_allocation(conn, id, shape).await?;
        }
        self.write_addresses(conn).await?;
        self.write_allocations(conn).await?;
        self.write_charges(conn).await?;
        self.write_views(conn).await?;
        self.views
            .retain(|_, v| v.state != vps_domain::state_table::InstanceState::Deleted);
        let views = std::mem::take(&mut self.views);
        *self = Batch {
            views,
            ..Batch::default()
        };
        Ok(())
    }

    /// The free list after the segment's claims and releases, then its leases.
    async fn write_addresses(&self, conn: &mut PgConnection) -> Result<(), ProjectionError> {
        if !self.addresses.is_empty() {
            let pools: Vec<&str> = self.addresses.keys().map(|k| k.0.as_str()).collect();
            let addresses: Vec<&str> = self.addresses.keys().map(|k| k.1.as_str()).collect();
            let last_claim: Vec<bool> = self.addresses.values().map(|v| v.0).collect();
            let any_claim: Vec<bool> = self.addresses.values().map(|v| v.1).collect();
            sqlx::query(concat!(
                "WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::bool[], $4::bool[])
                              AS u(pool_id, address, last_claim, any_claim)),
                 kept AS (SELECT u.pool_id, u.address FROM u JOIN pools p ON p.id = u.pool_id
                           WHERE NOT u.last_claim AND ",
                in_range!("u"),
                "), gone AS (DELETE FROM ip_free f USING u
                               WHERE f.pool_id = u.pool_id AND f.address = u.address
                                 AND u.any_claim
                                 AND NOT EXISTS (SELECT 1 FROM kept k
                                                  WHERE k.pool_id = u.pool_id
                                                    AND k.address = u.address))
                 INSERT INTO ip_free (pool_id, address) SELECT pool_id, address FROM kept
                 ON CONFLICT DO NOTHING"
            ))
            .bind(&pools)
            .bind(&addresses)
            .bind(&last_claim)
            .bind(&any_claim)
            .execute(&mut *conn)
            .await?;
        }
        if !self.leases.is_empty() {
            sqlx::query(
                "INSERT INTO ip_leases (pool_id, address, instance_id)
                 SELECT * FROM unnest($1::text[], $2::text[], $3::text[])",
            )
            .bind(
                self.leases
                    .values()
                    .map(|l| l.0.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                self.leases
                    .values()
                    .map(|l| l.1.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(self.leases.keys().map(String::as_str).collect::<Vec<_>>())
            .execute(&mut *conn)
            .await?;
        }
        Ok(())
    }

    async fn write_allocations(&self, conn: &mut PgConnection) -> Result<(), ProjectionError> {
        if self.allocations.is_empty() {
            return Ok(());
        }
        let all = &self.allocations;
        let shape = |f: fn(&Shape) -> i64| all.values().map(|a| f(&a.shape)).collect::<Vec<_>>();
        let insert = concat!(
            "INSERT INTO node_allocations (id, node_id, instance_id, vcpu, memory_gib, disk_gib, gpu_model, gpus)
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[],
                                  $6::bigint[], $7::text[], $8::bigint[])",
            bookings::returning!()
        );
        sqlx::query(&bookings::booking(insert, false))
            .bind(all.values().map(|a| a.id.as_str()).collect::<Vec<_>>())
            .bind(all.values().map(|a| a.node_id.as_str()).collect::<Vec<_>>())
            .bind(all.keys().map(String::as_str).collect::<Vec<_>>())
            .bind(shape(|s| s.vcpu as i64))
            .bind(shape(|s| s.memory_gib as i64))
            .bind(shape(|s| s.disk_gib as i64))
            .bind(
                all.values()
                    .map(|a| a.shape.gpus.as_ref().map(|g| g.model.as_str()))
                    .collect::<Vec<_>>(),
            )
            .bind(shape(|s| s.gpus.as_ref().map_or(0, |g| g.count as i64)))
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn write_charges(&self, conn: &mut PgConnection) -> Result<(), ProjectionError> {
        if self.charges.is_empty() {
            return Ok(());
        }
        let keys = self.charges.keys();
        sqlx::query(
            "INSERT INTO quotas (pool_id, tenant_id, resource, used)
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[])
             ON CONFLICT (pool_id, tenant_id, resource) DO UPDATE SET used = quotas.used + excluded.used",
        )
        .bind(keys.clone().map(|k| k.0.as_str()).collect::<Vec<_>>())
        .bind(keys.clone().map(|k| k.1.as_str()).collect::<Vec<_>>())
        .bind(keys.map(|k| k.2.as_str()).collect::<Vec<_>>())
        .bind(self.charges.values().copied().collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
        Ok(())
    }

    /// The views of instances created in the segment are new rows, copied; the others are
    /// upserted.
    async fn write_views(&self, conn: &mut PgConnection) -> Result<(), ProjectionError> {
        let (new, changed): (Vec<&Instance>, Vec<&Instance>) = self
            .dirty
            .iter()
            .filter_map(|id| self.views.get(id))
            .partition(|i| self.fresh.contains(&i.id));
        if !new.is_empty() {
            copy_views(conn, &new).await?;
        }
        if !changed.is_empty() {
            upsert_views(conn, &changed).await?;
        }
        Ok(())
    }
}

/// The columns a view is written to (`labels` is generated from `doc`).
const VIEW_COLUMNS: [&str; 14] = [
    "id",
    "tenant_id",
    "pool_id",
    "state",
    "desired_state",
    "node_id",
    "owner_identity_id",
    "warm",
    "doc",
    "created_at",
    "updated_at",
    "version",
    "warm_template_id",
    "template_version",
];

/// Copies views no row holds yet (the same values [`upsert_views`] writes).
async fn copy_views(conn: &mut PgConnection, all: &[&Instance]) -> Result<(), ProjectionError> {
    vps_pg::copy::copy_rows(conn, "instances", &VIEW_COLUMNS, all, |row, i| {
        row.field(&i.id.as_str())?;
        row.field(&i.tenant_id.as_str())?;
        row.field(&i.pool_id.as_str())?;
        row.field(&i.state.as_str())?;
        row.field(&i.desired_state.as_str())?;
        row.field(&i.node_id.as_deref())?;
        row.field(&i.owner_identity_id.as_str())?;
        row.field(&i.warm_template_id.is_some())?;
        row.jsonb(&instance_doc::stored(i))?;
        row.field(&i.created_at)?;
        row.field(&i.updated_at)?;
        row.field(&(i.version as i64))?;
        row.field(&i.warm_template_id.as_deref())?;
        row.field(&i.template_version.map(|v| v as i64))
    })
    .await?;
    Ok(())
}

/// Upserts views (their rows may exist).
async fn upsert_views(conn: &mut PgConnection, all: &[&Instance]) -> Result<(), ProjectionError> {
    let text = |f: fn(&Instance) -> Option<&str>| all.iter().map(|i| f(i)).collect::<Vec<_>>();
    sqlx::query(concat!(
        "INSERT INTO instances (id, tenant_id, pool_id, state, desired_state, node_id,
                                owner_identity_id, warm, doc, created_at, updated_at, version,
                                warm_template_id, template_version)
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                              $6::text[], $7::text[], $8::bool[], $9::jsonb[],
                              $10::timestamptz[], $11::timestamptz[], $12::bigint[],
                              $13::text[], $14::bigint[])",
        store_conflict!()
    ))
    .bind(text(|i| Some(&i.id)))
    .bind(text(|i| Some(&i.tenant_id)))
    .bind(text(|i| Some(&i.pool_id)))
    .bind(text(|i| Some(i.state.as_str())))
    .bind(text(|i| Some(i.desired_state.as_str())))
    .bind(text(|i| i.node_id.as_deref()))
    .bind(text(|i| Some(&i.owner_identity_id)))
    .bind(
        all.iter()
            .map(|i| i.warm_template_id.is_some())
            .collect::<Vec<_>>(),
    )
    .bind(
        all.iter()
            .map(|i| instance_doc::stored(i))
            .collect::<Vec<_>>(),
    )
    .bind(all.iter().map(|i| i.created_at).collect::<Vec<_>>())
    .bind(all.iter().map(|i| i.updated_at).collect::<Vec<_>>())
    .bind(all.iter().map(|i| i.version as i64).collect::<Vec<_>>())
    .bind(text(|i| i.warm_template_id.as_deref()))
    .bind(
        all.iter()
            .map(|i| i.template_version.map(|v| v as i64))
            .collect::<Vec<_>>(),
    )
    .execute(conn)
    .await?;
    Ok(())
}
