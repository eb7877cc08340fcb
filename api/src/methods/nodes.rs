//! `nodes.*`: the operator side (register, read, cordon) and the host seam (`spec`
//! long-poll, `report`, `secret`). A node calls with its own token and speaks only for
//! itself; operators may read and report for any node.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vps_commands::hosts::{self, Report};
use vps_commands::operator::{self as ops, RegisterNode};
use vps_commands::sandboxes::snapshots::StoredObject;
use vps_domain::image::STORE_SCHEME;
use vps_projections::node_spec_payload::{HostCommand, InstanceSpec, NodeSpec, SshCa};
use vps_projections::node_specs::StoredSpec;
use vps_projections::operator_views::{self, NodeView};
use vps_projections::views;

use super::missing;
use crate::error::ApiError;
use crate::registry::{Access, Answer, Call, Items, Method};
use vps_domain::ids::{NodeId, PoolId};

/// A node by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeRef {
    /// `node_…`.
    pub node_id: NodeId,
}

/// `nodes.list`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeList {
    /// Only this pool's nodes.
    pub pool_id: Option<PoolId>,
}

/// `nodes.spec`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SpecQuery {
    /// `node_…`.
    pub node_id: NodeId,
    /// Answer once the generation is newer than this.
    pub after_generation: Option<i64>,
    /// How long to hold the request (at most 30000).
    pub wait_ms: Option<u64>,
}

/// `nodes.secret`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretQuery {
    /// `node_…`.
    pub node_id: NodeId,
    /// `secret://…`.
    #[serde(rename = "ref")]
    pub reference: String,
}

/// What `nodes.report` changed.
#[derive(Serialize, schemars::JsonSchema)]
pub struct ReportAnswer {
    /// Instances whose state or data changed.
    pub updated: usize,
    /// Instances the node holds that nothing places there.
    pub orphans: Vec<String>,
}

/// A secret's plain value.
#[derive(Serialize, schemars::JsonSchema)]
pub struct SecretAnswer {
    /// The value.
    pub value: String,
}

/// The longest a spec request is held.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

/// The largest `nodes.report` body: a complete report of the most guests a report may list
/// (10,000), each with its addresses and a message, fits with room to spare. Other methods
/// keep the default 256 KiB.
pub const REPORT_MAX_BODY: usize = 16 * 1024 * 1024;

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    use Access::{Node, Operator};
    vec![
        Method::new(
            "nodes",
            "register",
            Operator,
            "Registers a node; answers its token once.",
            |c: Call, q: RegisterNode| async move { Ok(ops::register_node(&c.ctx, q).await?) },
        ),
        Method::new(
            "nodes",
            "get",
            Operator,
            "One node with its allocations.",
            get,
        ),
        Method::new(
            "nodes",
            "list",
            Operator,
            "Nodes, optionally of one pool.",
            list,
        ),
        Method::new(
            "nodes",
            "cordon",
            Operator,
            "Stops placing on a node.",
            |c: Call, q: NodeRef| async move { Ok(ops::set_cordon(&c.ctx, &q.node_id, true).await?) },
        ),
        Method::new(
            "nodes",
            "uncordon",
            Operator,
            "Places on a node again.",
            |c: Call, q: NodeRef| async move { Ok(ops::set_cordon(&c.ctx, &q.node_id, false).await?) },
        ),
        Method::new(
            "nodes",
            "spec",
            Node,
            "The node's NodeSpec (long-poll).",
            spec,
        ),
        Method::decided_on(
            "nodes",
            "report",
            Node,
            "What the node's runtime holds.",
            |r: &Report| &r.node_id,
            report,
        )
        .max_body(REPORT_MAX_BODY),
        Method::new(
            "nodes",
            "secret",
            Node,
            "A sealed secret of an instance placed on the node.",
            secret,
        ),
        Method::new(
            "nodes",
            "rotateToken",
            Operator,
            "Replaces a node's token; answers the new one once.",
            |c: Call, q: NodeRef| async move { Ok(ops::rotate_token(&c.ctx, &q.node_id).await?) },
        ),
    ]
}

async fn get(c: Call, q: NodeRef) -> Result<NodeView, ApiError> {
    operator_views::node(&c.ctx.pool, &q.node_id)
        .await?
        .ok_or_else(|| missing("node", &q.node_id))
}

async fn list(c: Call, q: NodeList) -> Result<Items<NodeView>, ApiError> {
    Ok(operator_views::nodes(&c.ctx.pool, q.pool_id.as_deref())
        .await?
        .into())
}

async fn spec(c: Call, q: SpecQuery) -> Result<ServedSpec, ApiError> {
    let wait = Duration::from_millis(q.wait_ms.unwrap_or(0));
    if wait > MAX_WAIT {
        return Err(ApiError::invalid("waitMs", "at most 30000"));
    }
    if !views::node_exists(&c.ctx.pool, &q.node_id).await? {
        return Err(missing("node", &q.node_id));
    }
    // Only a request that waits holds a place: a plain read returns at once.
    let _slot = if wait.is_zero() {
        None
    } else {
        Some(c.guards.long_poll(&q.node_id)?)
    };
    // Woken only when this replica hears the node's generation moved; the table decides.
    if let Some(after) = q.after_generation {
        let moved = c.spec_signals.subscribe(&q.node_id);
        crate::wait::woken_by(moved, RECHECK, Instant::now() + wait, || async {
            let generation =
                vps_projections::node_specs::generation(&c.ctx.pool, &q.node_id).await?;
            Ok((generation > after, ()))
        })
        .await?;
    }
    let mut conn = c.ctx.pool.acquire().await?;
    let stored = vps_projections::node_specs::load(&mut conn, &c.specs, &q.node_id).await?;
    drop(conn);
    let ttl = c.config.timings.snapshot_timeout();
    let ca = c.sandbox_ca.as_deref();
    // Only the entries that get something at serving time are parsed; the rest are written
    // as stored.
    let mut edited = HashMap::new();
    for (id, text) in stored.entries.iter() {
        if !served_with_more(text, ca.is_some()) {
            continue;
        }
        let mut entry: InstanceSpec =
            serde_json::from_str(text).map_err(|e| crate::error::internal(&e))?;
        sign_entry(&c.snapshots, &mut entry, ttl).await?;
        with_ssh_ca(&mut entry, ca);
        edited.insert(id.clone(), entry);
    }
    let mut commands = stored.commands.clone();
    sign_commands(&c.snapshots, &mut commands, ttl).await?;
    Ok(ServedSpec {
        stored,
        edited,
        commands,
    })
}

/// A NodeSpec as served: the stored entries as their JSON text, but for those completed when
/// served (`edited`: signed URLs, the sandbox CA), and the commands with their upload URLs.
/// Its JSON is [`NodeSpec`]'s.
struct ServedSpec {
    stored: StoredSpec,
    edited: HashMap<String, InstanceSpec>,
    commands: Vec<HostCommand>,
}

impl Answer for ServedSpec {
    fn to_json(&self) -> Vec<u8> {
        let entries = &self.stored.entries;
        let mut out =
            Vec::with_capacity(entries.values().map(|e| e.len() + 1).sum::<usize>() + 256);
        out.extend_from_slice(b"{\"nodeId\":");
        write(&mut out, &self.stored.node_id);
        out.extend_from_slice(b",\"generation\":");
        write(&mut out, &self.stored.generation);
        out.extend_from_slice(b",\"instances\":[");
        for (n, (id, text)) in entries.iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            match self.edited.get(id) {
                Some(entry) => write(&mut out, entry),
                None => out.extend_from_slice(text.as_bytes()),
            }
        }
        out.extend_from_slice(b"],\"volumes\":");
        write(&mut out, &self.stored.volumes);
        out.extend_from_slice(b",\"commands\":");
        write(&mut out, &self.commands);
        out.push(b'}');
        out
    }
}

/// Appends `value`'s JSON (as the registry writes a typed answer).
fn write(out: &mut Vec<u8>, value: &impl Serialize) {
    serde_json::to_writer(out, value).expect("serialises");
}

impl schemars::JsonSchema for ServedSpec {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        NodeSpec::schema_name()
    }

    fn schema_id() -> std::borrow::Cow<'static, str> {
        NodeSpec::schema_id()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        NodeSpec::json_schema(generator)
    }
}

/// Whether a stored entry gets something when served: a signed URL (an image kept in the
/// store, a restore's object) or, with a sandbox CA, the CA its guest's `sshd` admits. A
/// look at the text, no parse: a field it lacks is not there (absent fields are left out).
fn served_with_more(text: &str, with_ca: bool) -> bool {
    text.contains(STORE_SCHEME)
        || text.contains("\"restoreFrom\"")
        || (with_ca && text.contains("\"sshFromHostOnly\""))
}

/// Tells each sandbox and warm instance whom its guest's `sshd` admits: the deployment's
/// sandbox CA, for the principal exec certificates name (the instance id). Added when served,
/// as the CA is configuration, not part of the log.
fn with_ssh_ca(
    instance: &mut InstanceSpec,
    ca: Option<&vps_commands::sandboxes::exec::ca::SandboxCa>,
) {
    let Some(ca) = ca else {
        return;
    };
    if instance.ssh_from_host_only == Some(true) {
        instance.ssh_ca = Some(SshCa {
            public_key: ca.public_key().to_string(),
            principal: instance.id.clone(),
        });
    }
}

/// How long a poll trusts its node's signals before reading the generation again (a lost
/// notification delays an answer at most this much).
const RECHECK: Duration = Duration::from_secs(1);

/// Replaces the `objectKey` of each command with an upload URL (and its headers) signed now.
/// Signed when served, so a URL never outlives its use by much and never sits in a table.
async fn sign_commands(
    store: &vps_store::SnapshotStore,
    commands: &mut [HostCommand],
    ttl: Duration,
) -> Result<(), ApiError> {
    for command in commands {
        let Some(key) = command.object_key.take() else {
            continue;
        };
        let upload = store
            .upload(&key, ttl)
            .await
            .map_err(|e| crate::error::internal(&e))?;
        command.upload_url = Some(upload.url);
        command.upload_headers = Some(upload.headers);
    }
    Ok(())
}

/// Replaces an entry's object references with download URLs signed now: its `restoreFrom`'s
/// object, and its image when the store keeps it (`store://…`).
async fn sign_entry(
    store: &vps_store::SnapshotStore,
    instance: &mut InstanceSpec,
    ttl: Duration,
) -> Result<(), ApiError> {
    let unsigned = |e: vps_store::StoreError| crate::error::internal(&e);
    // An imported image: its object, for as long as a restore's.
    let stored = instance
        .image
        .url
        .as_deref()
        .and_then(|u| u.strip_prefix(STORE_SCHEME));
    if let Some(key) = stored {
        instance.image.url = Some(store.download(key, ttl).await.map_err(unsigned)?);
    }
    let Some(restore) = instance.restore_from.as_mut() else {
        return Ok(());
    };
    let Some(key) = restore.object_key.take() else {
        return Ok(());
    };
    restore.url = Some(store.download(&key, ttl).await.map_err(unsigned)?);
    Ok(())
}

async fn report(c: Call, mut report: Report) -> Result<ReportAnswer, ApiError> {
    // The store's own digest of each upload, read before the report's transaction: settlement
    // fails a snapshot whose reported digest is not the stored bytes' (`digest-mismatch`).
    for (id, key) in hosts::uploaded_objects(&c.ctx, &report).await? {
        let stored = c
            .snapshots
            .stored_sha256(&key)
            .await
            .map_err(|e| crate::error::internal(&e))?;
        let stored = match stored {
            vps_store::Stored::Sha256(digest) => StoredObject::Sha256(digest),
            vps_store::Stored::Absent => StoredObject::Absent,
            vps_store::Stored::Unchecked => continue,
        };
        report.stored.insert(id, stored);
    }
    let outcome = hosts::report(&c.ctx, report).await?;
    Ok(ReportAnswer {
        updated: outcome.updated,
        orphans: outcome.orphans,
    })
}

async fn secret(c: Call, q: SecretQuery) -> Result<SecretAnswer, ApiError> {
    // Cedar's baseline lets only the node itself read its instances' secrets.
    let value = hosts::node_secret(&c.ctx, &q.node_id, &q.reference).await?;
    Ok(SecretAnswer { value })
}
