//! Projectors turn events into rows. Inline projectors run inside a command's transaction
//! (`apply`); every projection can be rebuilt from the log and compared with the live one
//! (`replay`). Each projector is a deterministic function of the event and projection tables:
//! time comes from the event, never from `now()`.
//!
//! Projectors are routed by stream category, one module per table family: `pools` (pools and
//! quota maxima), `nodes`, `flavors`, `images`, `instances` (instance views, quota usage, node
//! allocations and their sums on the nodes' rows (`bookings`), IP leases; their reads in
//! `instances::admission` and `instances::reads`), `node_specs` (the async NodeSpec projector;
//! `node_spec_volumes` its volume part), `instance_doc` (the stored form of an instance),
//! `provider_accounts`, `webhooks`, `sandboxes` (templates, sandboxes and snapshots;
//! `sandboxes::reads` their reads), `volumes` (sandbox volumes, their allocations and quota
//! charges), `policies`, `identities`, `tenants` (teardown), `usage` (usage records and
//! rollups), `views` and `operator_views` (reads), `replay` (rebuild and verify; its new rows
//! are written with `vps_pg::copy`).
//!
//! Reads live with their tables: `commands`, `reactors`, `api` and `devtools` read a
//! projection table through its module's query functions (typed rows, the SQL and locking
//! their callers tuned), never with SQL of their own. A few statements are the exception, as
//! each also writes a table of its owner's in the same round trip: the webhook dispatcher's
//! lease (`webhook_leases`, joining `webhooks`), a host report's node lock
//! (`node_heartbeats`, reading `nodes`), and idle pause's activity rows (`sandbox_activity`,
//! reading `sandbox_templates` and `sandboxes`: `commands::sandboxes::activity`). See
//! docs/decisions/0022.
//!
//! Nothing outside this crate writes a projection table. Projector SQL names tables without a
//! schema, so a replay can point `search_path` at a scratch schema.

mod bookings;
pub mod flavors;
pub mod identities;
pub mod images;
pub mod instance_doc;
pub mod instances;
pub mod node_spec_payload;
pub mod node_spec_volumes;
pub mod node_specs;
pub mod nodes;
pub mod operator_views;
mod pages;
pub mod policies;
pub mod pools;
pub mod provider_accounts;
pub mod replay;
pub mod sandboxes;
mod spec_entries;
pub mod spec_signals;
pub mod tenants;
pub mod usage;
pub mod views;
pub mod volumes;
pub mod webhooks;

use sqlx::PgConnection;
use vps_domain::aggregate::Aggregate;
use vps_domain::instance::Instance;
use vps_domain::sandbox::Sandbox;
use vps_events::RecordedEvent;

/// A projector could not apply an event.
#[derive(Debug, thiserror::Error)]
pub enum ProjectionError {
    /// The event's data does not have the shape its type promises.
    #[error("event {event_id} ({event_type}) has malformed data: {message}")]
    Malformed {
        /// The event.
        event_id: String,
        /// Its type.
        event_type: String,
        /// What is wrong.
        message: String,
    },
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A replay's reader of the log stopped without answering (it panicked).
    #[error("the replay's reader of the log stopped: {0}")]
    Reader(String),
}

/// Every projection table, in the order a rebuild creates and compares them.
pub const TABLES: &[&str] = &[
    "pools",
    "quotas",
    "nodes",
    "flavors",
    "images",
    "instances",
    "node_allocations",
    "ip_leases",
    "ip_free",
    "node_specs",
    "node_spec_entries",
    "provider_accounts",
    "webhooks",
    "sandbox_templates",
    "sandboxes",
    "sandbox_snapshots",
    "sandbox_volumes",
    "node_spec_volumes",
    "policies",
    "identities",
    "tenants",
    "usage_records",
    "usage_rollups",
];

/// The stream categories some inline projector takes (`apply` leaves every other event be).
pub(crate) const PROJECTED: &[&str] = &[
    "instance",
    "pool",
    "node",
    "flavor",
    "image",
    "provider_account",
    "webhook",
    "tenant",
    "template",
    "sandbox",
    "volume",
    "policy",
    "identity",
    "tenancy",
];

/// Applies every inline projector to one event, in the caller's transaction.
pub async fn apply(conn: &mut PgConnection, event: &RecordedEvent) -> Result<(), ProjectionError> {
    match event.category() {
        "instance" => instances::apply(conn, event).await,
        "pool" => pools::apply(conn, event).await,
        "node" => nodes::apply(conn, event).await,
        "flavor" => flavors::apply(conn, event).await,
        "image" => images::apply(conn, event).await,
        "provider_account" => provider_accounts::apply(conn, event).await,
        "webhook" => Ok(webhooks::apply(conn, event).await?),
        "tenant" if event.event_type == vps_domain::usage::record::EVENT_TYPE => {
            usage::apply(conn, event).await
        }
        "template" => sandboxes::apply_template(conn, event).await,
        "sandbox" => sandboxes::apply_sandbox(conn, event, None).await,
        "volume" => volumes::apply(conn, event).await,
        "policy" => policies::apply(conn, event).await,
        "identity" => identities::apply(conn, event).await,
        "tenancy" => tenants::apply(conn, event).await,
        _ => Ok(()),
    }
}

/// Applies every inline projector to events just appended, in order. Consecutive events of one
/// instance are applied as a run (one read and one write of its view). `prior`: the aggregate
/// the appending command decided on, whose view then need not be read back.
pub async fn apply_all(
    conn: &mut PgConnection,
    events: &[RecordedEvent],
    prior: Prior<'_>,
) -> Result<(), ProjectionError> {
    let mut rest = events;
    while let Some(first) = rest.first() {
        match first.category() {
            "instance" => {
                let n = rest.iter().take_while(|e| e.stream == first.stream).count();
                instances::apply_run(conn, &rest[..n], prior.instance()).await?;
                rest = &rest[n..];
                continue;
            }
            "sandbox" => sandboxes::apply_sandbox(conn, first, prior.sandbox()).await?,
            _ => apply(conn, first).await?,
        }
        rest = &rest[1..];
    }
    Ok(())
}

/// The aggregate a command decided on, as its view stands before the command's events: read
/// in the command's transaction, under the lock (or the stream version) that orders the
/// stream's writers. A projector uses it only for the event right after it (same id, next
/// version), and reads the view otherwise.
#[derive(Debug, Clone, Copy)]
pub enum Prior<'a> {
    /// Read the view.
    Unknown,
    /// An instance.
    Instance(&'a Instance),
    /// A sandbox.
    Sandbox(&'a Sandbox),
}

impl<'a> Prior<'a> {
    /// The prior of an aggregate of any type (those whose views are not read back are
    /// [`Prior::Unknown`]).
    pub fn of(state: &'a dyn std::any::Any) -> Prior<'a> {
        if let Some(i) = state.downcast_ref::<Instance>() {
            Prior::Instance(i)
        } else if let Some(s) = state.downcast_ref::<Sandbox>() {
            Prior::Sandbox(s)
        } else {
            Prior::Unknown
        }
    }

    fn instance(self) -> Option<&'a Instance> {
        match self {
            Prior::Instance(i) => Some(i),
            _ => None,
        }
    }

    fn sandbox(self) -> Option<&'a Sandbox> {
        match self {
            Prior::Sandbox(s) => Some(s),
            _ => None,
        }
    }
}

/// The state before `e` without reading its view, when that is known: nothing before a
/// stream's first event, or the command's prior when it is this stream's state right before
/// `e`. `Err(())`: read the view.
pub(crate) fn known_before<A: Aggregate>(
    e: &RecordedEvent,
    prior: Option<&A>,
    id_of: impl Fn(&A) -> &str,
) -> Result<Option<A>, ()> {
    if e.version == 1 {
        return Ok(None);
    }
    match prior {
        Some(p) if p.version() as i64 == e.version - 1 && A::stream(id_of(p)) == e.stream => {
            Ok(Some(p.clone()))
        }
        _ => Err(()),
    }
}

/// Parses a stored event as its stream's typed event.
pub(crate) fn typed<E: vps_domain::aggregate::Event>(
    event: &RecordedEvent,
) -> Result<E, ProjectionError> {
    E::from_parts(&event.event_type, event.data.clone()).map_err(|e| ProjectionError::Malformed {
        event_id: event.id.clone(),
        event_type: event.event_type.clone(),
        message: e.to_string(),
    })
}
