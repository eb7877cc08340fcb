//! NodeSpecs: per node, every live instance placed on it, as the host must run it, kept as one
//! entry per instance (`node_spec_entries`), and the volumes it keeps (`node_spec_volumes`). The node's generation (`node_specs`) moves only
//! when an entry of it changes, so hosts can long-poll for a change.
//!
//! An async projector: a follower (`run`) rewrites the entries of the instances a batch of
//! events touched, from the instance views as they stand, in one transaction with its
//! checkpoint; one instance event costs one entry, not the node's whole spec. Commands never
//! wait for it. The entries are a function of the views (a replay compares them); the
//! generation counts changes, so it is not compared.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{Connection, PgConnection, Row};
use tracing::Instrument;
use vps_domain::aggregate::Aggregate;
use vps_domain::instance::Instance;
use vps_domain::sandbox::snapshot::object_key;
use vps_domain::sandbox::Sandbox;

use crate::node_spec_payload::{
    HostCommand, ImageRef, InstanceSpec, Nic, NodeSpec, NodeVolume, SpecRestore,
};
pub use crate::spec_entries::Moved;
use crate::spec_entries::{bump, ids_or_node, write, EntryTable};
use crate::ProjectionError;

/// The bridge hosted instances' NICs attach to.
pub const BRIDGE: &str = "br0";

/// One spec entry: (node, instance) and what the host must run.
type Entry = ((String, String), Value);

/// The entries the instances' views call for: `ids` (or, with `node`, every instance on it).
/// Unplaced instances are left out here, not in the statement: a kept plan for `node_id IS NOT
/// NULL` can read every placed instance through the node index ([`ids_or_node`]).
async fn desired(
    conn: &mut PgConnection,
    ids: &[String],
    node: Option<&str>,
) -> Result<Vec<Entry>, ProjectionError> {
    let which = ids_or_node("i.id", "i.node_id", node);
    let rows = sqlx::query(&format!(
        "SELECT i.doc, p.runtime, p.ip_cidr, im.url, im.sha256, im.format, p.ip_gateway
           FROM instances i
           JOIN pools p ON p.id = i.pool_id
           LEFT JOIN images im ON im.id = (i.doc->>'imageId')
          WHERE {which} AND i.state NOT IN ('pending', 'scheduling', 'deleted')"
    ))
    .bind(ids)
    .bind(node)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let inst = crate::instance_doc::instance(r.get(0));
            let node = inst.node_id.clone()?;
            let prefix = r
                .get::<Option<String>, _>(2)
                .and_then(|c| c.split_once('/').map(|(_, p)| p.to_string()))
                .unwrap_or_else(|| "32".into());
            let network = Network {
                prefix,
                gateway: r.get(6),
            };
            let value = entry(&inst, r.get(1), &network, (r.get(3), r.get(4), r.get(5)));
            Some(((node, inst.id.clone()), value))
        })
        .collect())
}

/// The instances' entries.
const INSTANCE_ENTRIES: EntryTable = EntryTable {
    table: "node_spec_entries",
    key: "instance_id",
};

/// Makes the stored entries of `ids` (or of `node`) what the views call for, and moves the
/// generation of every node an entry of which changed.
async fn sync(
    conn: &mut PgConnection,
    ids: &[String],
    node: Option<&str>,
) -> Result<Moved, ProjectionError> {
    let want = desired(conn, ids, node).await?.into_iter().collect();
    write(conn, &INSTANCE_ENTRIES, ids, node, want).await
}

/// Writes one instance's entry in a command's own transaction, for a change its host must see
/// without waiting for the follower: a warm claim, whose sandbox is ready only once the host
/// resumes it. The follower's later pass over the same events finds the entry as it wants it
/// and moves nothing. Answers the generation that moved, to announce once the command commits
/// ([`crate::spec_signals::announce`]).
///
/// The node must already have a spec row (a claimed instance's own entry made it): the row's
/// lock is what keeps the follower from writing back an older entry ([`lock_nodes_of`]).
pub async fn write_inline(
    conn: &mut PgConnection,
    instance_id: &str,
) -> Result<Moved, ProjectionError> {
    sync(conn, &[instance_id.to_string()], None).await
}

/// Locks the spec rows of the nodes `ids` are placed on, in node order, before their views are
/// read. A command that wrote an entry inline holds its node's row until it commits, so the
/// pass reads the views after that commit and never writes back an entry older than the one the
/// command wrote.
async fn lock_nodes_of(conn: &mut PgConnection, ids: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT 1 FROM node_specs
          WHERE node_id IN (SELECT node_id FROM instances WHERE id = ANY($1))
          ORDER BY node_id FOR UPDATE",
    )
    .bind(ids)
    .execute(conn)
    .await?;
    Ok(())
}

/// Recomputes every entry of a node (a replay, or an image or range change); answers the
/// generations that moved.
pub async fn refresh(conn: &mut PgConnection, node_id: &str) -> Result<Moved, ProjectionError> {
    let mut moved = sync(conn, &[], Some(node_id)).await?;
    moved.extend(crate::node_spec_volumes::sync(conn, &[], Some(node_id)).await?);
    Ok(moved)
}

/// What an instance's NIC takes from its pool's range.
struct Network {
    /// The range's prefix length (`24`).
    prefix: String,
    gateway: Option<String>,
}

fn entry(
    inst: &Instance,
    runtime: Option<String>,
    network: &Network,
    image: (Option<String>, Option<String>, Option<String>),
) -> Value {
    let sandboxed = inst.sandbox_id.is_some() || inst.warm_template_id.is_some();
    let spec = InstanceSpec {
        id: inst.id.clone(),
        desired_state: inst.desired_state,
        runtime,
        shape: inst.shape.clone(),
        image: ImageRef {
            url: image.0,
            sha256: image.1,
            format: image.2,
        },
        user_data_ref: inst.user_data_ref.clone(),
        allocation_id: inst.allocation_id.clone(),
        gpus: inst.shape.gpus.iter().cloned().collect(),
        nics: inst
            .addresses
            .first()
            .map(|a| Nic {
                bridge: BRIDGE.into(),
                mac: vps_domain::ids::mac_for(&inst.id),
                address: format!("{a}/{}", network.prefix),
                gateway: network.gateway.clone(),
            })
            .into_iter()
            .collect(),
        // Sandbox and warm instances: the template's network rule, and SSH only from the host.
        network_policy: inst.network_policy,
        network_allow: inst.network_rules.allow.clone(),
        network_bandwidth_mbit: inst.network_rules.bandwidth_mbit,
        network_max_connections: inst.network_rules.max_connections,
        ssh_from_host_only: sandboxed.then_some(true),
        // The download URL is signed when the spec is served; the entry names the object.
        restore_from: inst.restore_from.as_ref().map(|r| SpecRestore {
            snapshot_id: r.snapshot_id.clone(),
            sha256: r.sha256.clone(),
            include_memory: r.include_memory,
            object_key: Some(object_key(&inst.tenant_id, &r.snapshot_id)),
            url: None,
        }),
        volumes: crate::node_spec_volumes::attachments(&inst.volumes),
        start_generation: (inst.starts > 0).then_some(inst.starts),
        ssh_ca: None,
    };
    serde_json::to_value(spec).expect("a spec entry serialises")
}

/// The generation of a node's spec (0 before its first entry).
pub async fn generation<'e>(
    db: impl sqlx::PgExecutor<'e>,
    node_id: &str,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT coalesce((SELECT generation FROM node_specs WHERE node_id = $1), 0)")
        .bind(node_id)
        .fetch_one(db)
        .await
}

/// A replica's copy of its nodes' instance entries: serving a spec reads again only the
/// entries written after the generation the copy was read at, so a long poll that answers one
/// change on a node of thousands of instances costs one entry, not thousands.
#[derive(Debug, Default)]
pub struct SpecCache {
    nodes: Mutex<HashMap<String, Held>>,
}

/// One node's entries as read at `generation` (or later), as JSON text: a parsed entry takes
/// several times the memory, and a replica holds every entry of every node.
#[derive(Debug, Clone)]
struct Held {
    generation: i64,
    entries: Arc<BTreeMap<String, Arc<str>>>,
}

impl SpecCache {
    fn held(&self, node_id: &str) -> Option<Held> {
        self.nodes.lock().ok()?.get(node_id).cloned()
    }

    fn hold(&self, node_id: &str, held: Held) {
        if let Ok(mut nodes) = self.nodes.lock() {
            nodes.insert(node_id.to_string(), held);
        }
    }
}

/// A node's spec as stored, with its generation (an empty spec at generation 0 before any
/// instance): its instance entries as the JSON text of each [`InstanceSpec`] (shared with the
/// replica's copy, so serving them costs no parse), its volumes, and its host commands: the
/// snapshots it has to take, until it reports them. A command names its object
/// (`objectKey`); the upload URL is signed when the spec is served.
#[derive(Debug, Clone)]
pub struct StoredSpec {
    /// `node_…`.
    pub node_id: String,
    /// Moves whenever the content changes, and only then.
    pub generation: i64,
    /// Each instance's entry (an [`InstanceSpec`] as JSON text), by instance id.
    pub entries: Arc<BTreeMap<String, Arc<str>>>,
    /// The volumes the host keeps.
    pub volumes: Vec<NodeVolume>,
    /// Host commands (snapshots) to run until their outcome is reported.
    pub commands: Vec<HostCommand>,
}

impl StoredSpec {
    /// The spec typed (every entry parsed), as a host reads it before the serving-time
    /// additions.
    pub fn typed(&self) -> Result<NodeSpec, serde_json::Error> {
        Ok(NodeSpec {
            node_id: self.node_id.clone(),
            generation: self.generation,
            instances: self
                .entries
                .values()
                .map(|text| serde_json::from_str(text))
                .collect::<Result<_, _>>()?,
            volumes: self.volumes.clone(),
            commands: self.commands.clone(),
        })
    }
}

/// The node's stored spec; its instance entries from the replica's copy, reading only those
/// written after the generation the copy was read at.
pub async fn load(
    conn: &mut PgConnection,
    cache: &SpecCache,
    node_id: &str,
) -> Result<StoredSpec, sqlx::Error> {
    // The generation is read first: entries newer than it only make the host's next poll
    // answer at once, and a change committed after the read is never labelled as seen.
    let generation = generation(&mut *conn, node_id).await?;
    let held = cache.held(node_id).filter(|h| h.generation <= generation);
    let entries = match held {
        Some(held) => match changed_entries(conn, node_id, &held).await? {
            Some(entries) => entries,
            // An entry left the node since: read them all.
            None => all_entries(conn, node_id).await?,
        },
        None => all_entries(conn, node_id).await?,
    };
    cache.hold(
        node_id,
        Held {
            generation,
            entries: entries.clone(),
        },
    );
    let volumes: Vec<Json<NodeVolume>> = sqlx::query_scalar(
        "SELECT entry FROM node_spec_volumes WHERE node_id = $1 ORDER BY volume_id",
    )
    .bind(node_id)
    .fetch_all(&mut *conn)
    .await?;
    let pending: Vec<(String, String, bool, String)> = sqlx::query_as(
        "SELECT id, instance_id, include_memory, tenant_id
           FROM sandbox_snapshots WHERE node_id = $1 AND state = 'pending'
          ORDER BY created_at, id",
    )
    .bind(node_id)
    .fetch_all(&mut *conn)
    .await?;
    let commands = pending
        .into_iter()
        .map(|(id, instance_id, include_memory, tenant_id)| HostCommand {
            object_key: Some(object_key(&tenant_id, &id)),
            id,
            kind: "snapshot".into(),
            instance_id,
            include_memory,
            upload_url: None,
            upload_headers: None,
        })
        .collect();
    Ok(StoredSpec {
        node_id: node_id.to_string(),
        generation,
        entries,
        volumes: volumes.into_iter().map(|v| v.0).collect(),
        commands,
    })
}

/// Every instance entry of the node.
async fn all_entries(
    conn: &mut PgConnection,
    node_id: &str,
) -> Result<Arc<BTreeMap<String, Arc<str>>>, sqlx::Error> {
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT instance_id, entry::text FROM node_spec_entries WHERE node_id = $1")
            .bind(node_id)
            .fetch_all(&mut *conn)
            .await?;
    Ok(Arc::new(
        rows.into_iter().map(|(id, e)| (id, Arc::from(e))).collect(),
    ))
}

/// `held`'s entries with those written after its generation read (through the index of the
/// node's generations, not a scan of its entries); `None` when an entry left the node since
/// (the node's count of entries is not that of the copy and the entries read).
async fn changed_entries(
    conn: &mut PgConnection,
    node_id: &str,
    held: &Held,
) -> Result<Option<Arc<BTreeMap<String, Arc<str>>>>, sqlx::Error> {
    let (count, ids, texts): (i64, Vec<String>, Vec<String>) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM node_spec_entries WHERE node_id = $1),
                ARRAY(SELECT instance_id FROM node_spec_entries
                       WHERE node_id = $1 AND generation > $2 ORDER BY instance_id),
                ARRAY(SELECT entry::text FROM node_spec_entries
                       WHERE node_id = $1 AND generation > $2 ORDER BY instance_id)",
    )
    .bind(node_id)
    .bind(held.generation)
    .fetch_one(&mut *conn)
    .await?;
    if ids.is_empty() {
        return Ok((count as usize == held.entries.len()).then(|| held.entries.clone()));
    }
    let mut entries = (*held.entries).clone();
    for (id, text) in ids.into_iter().zip(texts) {
        entries.insert(id, Arc::from(text));
    }
    // The copy and what was read name every entry there is (and maybe some that left).
    Ok((count as usize == entries.len()).then(|| Arc::new(entries)))
}

/// The follower's (and lease's) name.
pub const FOLLOWER: &str = "node-specs";

/// What a batch may have changed: the instances and volumes its events name, and the nodes
/// whose every entry an image or range change may touch (rare: those nodes are recomputed
/// whole).
async fn touched(
    conn: &mut PgConnection,
    batch: &[vps_events::RecordedEvent],
) -> Result<(Vec<String>, Vec<String>, Vec<String>, Vec<String>), sqlx::Error> {
    let mut instances = BTreeSet::new();
    let mut snapshots = BTreeSet::new();
    let mut volumes = BTreeSet::new();
    let mut whole = false;
    for e in batch {
        if Instance::id_of_stream(&e.stream).is_some() {
            if let Some(i) = e.data["instanceId"].as_str() {
                instances.insert(i.to_string());
            }
        }
        // A snapshot asked for or settled adds or drops a host command.
        if Sandbox::id_of_stream(&e.stream).is_some() {
            use vps_domain::sandbox::SandboxEvent as S;
            match crate::typed::<S>(e) {
                Ok(S::SnapshotRequested(r)) => snapshots.insert(r.snapshot_id),
                Ok(S::SnapshotReady(r)) => snapshots.insert(r.snapshot_id),
                Ok(S::SnapshotFailed(r)) => snapshots.insert(r.snapshot_id),
                _ => false,
            };
        }
        if let Some(v) = e.stream.strip_prefix("volume-") {
            volumes.insert(v.to_string());
        }
        whole |= e.event_type.starts_with("image.") || e.event_type == "pool.ip_range.set";
    }
    let commanded: Vec<String> = match snapshots.is_empty() {
        true => Vec::new(),
        false => sqlx::query_scalar(
            "SELECT DISTINCT node_id FROM sandbox_snapshots WHERE id = ANY($1) ORDER BY node_id",
        )
        .bind(snapshots.into_iter().collect::<Vec<_>>())
        .fetch_all(&mut *conn)
        .await?,
    };
    let nodes = match whole {
        true => {
            sqlx::query_scalar("SELECT id FROM nodes")
                .fetch_all(&mut *conn)
                .await?
        }
        false => Vec::new(),
    };
    Ok((
        instances.into_iter().collect(),
        volumes.into_iter().collect(),
        nodes,
        commanded,
    ))
}

/// Brings the entries a batch touched up to date and moves the checkpoint, in one transaction
/// on `conn`; answers the generations that moved. A batch that touches no entry only passes
/// over.
pub async fn apply_batch(
    conn: &mut PgConnection,
    follower: &mut vps_events::Follower,
    batch: &[vps_events::RecordedEvent],
) -> Result<Moved, ProjectionError> {
    let Some(last) = batch.last().map(vps_events::RecordedEvent::cursor) else {
        return Ok(Moved::new());
    };
    let (instances, volumes, nodes, commanded) = touched(&mut *conn, batch).await?;
    if instances.is_empty() && volumes.is_empty() && nodes.is_empty() && commanded.is_empty() {
        // No entry to write: no commit, which would hold back every follower's reads.
        follower.pass_over(last).await?;
        return Ok(Moved::new());
    }
    let mut tx = conn.begin_with(vps_pg::connect::BEGIN_KEYED).await?;
    let mut moved = Moved::new();
    if !instances.is_empty() {
        lock_nodes_of(&mut tx, &instances).await?;
        moved.extend(sync(&mut tx, &instances, None).await?);
    }
    if !volumes.is_empty() {
        moved.extend(crate::node_spec_volumes::sync(&mut tx, &volumes, None).await?);
    }
    if !commanded.is_empty() {
        moved.extend(bump(&mut tx, &commanded).await?);
    }
    for node in nodes {
        moved.extend(refresh(&mut tx, &node).await?);
    }
    vps_events::follower::save_checkpoint(&mut *tx, FOLLOWER, last).await?;
    tx.commit().await?;
    follower.advance(last);
    Ok(moved)
}

/// The least time between two reads of the log when woken: in a busy moment one pass
/// refreshes the specs of several commits.
const PACE: std::time::Duration = std::time::Duration::from_millis(10);

/// Runs the projector for as long as the task lives (one replica at a time).
pub async fn run(
    pool: sqlx::PgPool,
    notifier: vps_events::Notifier,
    signals: Arc<crate::spec_signals::SpecSignals>,
) -> Result<(), ProjectionError> {
    let _lease =
        vps_events::lease::Lease::acquire(&pool, FOLLOWER, std::time::Duration::from_secs(2)).await;
    let mut follower = vps_events::Follower::load(pool.clone(), FOLLOWER, &notifier)
        .await?
        .paced(PACE);
    // Kept for every pass (the pool hands out the connection idle longest, caches cold); a
    // failed pass ends the task, and the restarted one takes another.
    let mut conn = pool.acquire().await?;
    loop {
        let batch = follower.next_batch(2000).await?;
        if batch.is_empty() {
            follower.report_lag().await?;
            follower.wait().await;
            continue;
        }
        let span = tracing::info_span!("node_spec_pass", events = batch.len());
        let moved = apply_batch(&mut conn, &mut follower, &batch)
            .instrument(span)
            .await?;
        // Hosts long-polling their spec wait on this, each on its own node's.
        crate::spec_signals::announce(&notifier, &signals, &moved);
        follower.wait_unless_full().await;
    }
}

/// Recomputes every node's spec (a replay's last step).
pub async fn refresh_all(conn: &mut PgConnection) -> Result<(), ProjectionError> {
    let nodes: Vec<String> = sqlx::query_scalar("SELECT id FROM nodes ORDER BY id")
        .fetch_all(&mut *conn)
        .await?;
    for node in nodes {
        refresh(conn, &node).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries told apart by their allocation id, `alloc_<n>`.
    fn entries(pairs: &[(&str, i64)]) -> BTreeMap<(String, String), Value> {
        pairs
            .iter()
            .map(|(id, n)| {
                let spec = InstanceSpec {
                    id: id.to_string(),
                    desired_state: vps_domain::state_table::DesiredState::Running,
                    runtime: None,
                    shape: vps_domain::resources::Shape {
                        vcpu: 1,
                        memory_gib: 1,
                        disk_gib: 1,
                        gpus: None,
                    },
                    image: ImageRef {
                        url: None,
                        sha256: None,
                        format: None,
                    },
                    user_data_ref: None,
                    allocation_id: Some(format!("alloc_{n}")),
                    gpus: vec![],
                    nics: vec![],
                    network_policy: None,
                    network_allow: vec![],
                    network_bandwidth_mbit: None,
                    network_max_connections: None,
                    ssh_from_host_only: None,
                    restore_from: None,
                    volumes: vec![],
                    start_generation: None,
                    ssh_ca: None,
                };
                let key = ("node_a".to_string(), id.to_string());
                (key, serde_json::to_value(spec).unwrap())
            })
            .collect()
    }

    fn allocations(spec: &NodeSpec) -> Vec<(&str, Option<&str>)> {
        spec.instances
            .iter()
            .map(|i| (i.id.as_str(), i.allocation_id.as_deref()))
            .collect()
    }

    async fn write_entries(conn: &mut PgConnection, ids: &[&str], want: &[(&str, i64)]) {
        let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
        write(conn, &INSTANCE_ENTRIES, &ids, None, entries(want))
            .await
            .expect("entries written");
    }

    #[tokio::test]
    async fn a_held_spec_serves_what_a_fresh_read_would_through_changes_and_removals() {
        let db = vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 2).await;
        let mut conn = db.acquire().await.unwrap();
        let held = SpecCache::default();
        write_entries(&mut conn, &["a", "b"], &[("a", 1), ("b", 1)]).await;
        async fn spec(conn: &mut PgConnection, cache: &SpecCache) -> NodeSpec {
            let stored = load(conn, cache, "node_a").await.unwrap();
            stored.typed().unwrap()
        }
        let first = spec(&mut conn, &held).await;
        assert_eq!(first.instances.len(), 2);

        // One entry changes, one goes, one comes: the held copy must follow all three.
        write_entries(&mut conn, &["a", "b", "c"], &[("a", 2), ("c", 1)]).await;
        let served = spec(&mut conn, &held).await;
        let fresh = spec(&mut conn, &SpecCache::default()).await;
        assert_eq!(served, fresh);
        assert_eq!(
            allocations(&served),
            [("a", Some("alloc_2")), ("c", Some("alloc_1"))]
        );
        assert!(served.generation > first.generation);

        // Unchanged: the same spec at the same generation.
        assert_eq!(spec(&mut conn, &held).await, served);

        // One goes and nothing comes: the count tells the copy it holds one too many.
        write_entries(&mut conn, &["c"], &[]).await;
        let served = spec(&mut conn, &held).await;
        assert_eq!(served, spec(&mut conn, &SpecCache::default()).await);
        assert_eq!(allocations(&served), [("a", Some("alloc_2"))]);
    }
}
