//! `nodes.*`: the operator side (register, read, cordon) and the host seam (`spec`
//! long-poll, `report`, `secret`). A node calls with its own token and speaks only for
//! itself; operators may read and report for any node.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vps_commands::hosts::{self, Report};
use vps_commands::operator::{self as ops, RegisterNode};
use vps_commands::sandboxes::snapshots::StoredObject;
use vps_domain::image::STORE_SCHEME;
use vps_projections::node_spec_payload::{NodeSpec, SshCa};
use vps_projections::operator_views::{self, NodeView};
use vps_projections::views;

use super::missing;
use crate::error::ApiError;
use crate::registry::{Access, Call, Items, Method};
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
        Method::new(
            "nodes",
            "report",
            Node,
            "What the node's runtime holds.",
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

async fn spec(c: Call, q: SpecQuery) -> Result<NodeSpec, ApiError> {
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
    let spec = vps_projections::node_specs::load(&mut conn, &c.specs, &q.node_id).await?;
    let ttl = c.config.timings.snapshot_timeout();
    let spec = sign_objects(&c.snapshots, spec, ttl).await?;
    Ok(with_ssh_ca(spec, c.sandbox_ca.as_deref()))
}

/// Tells each sandbox and warm instance whom its guest's `sshd` admits: the deployment's
/// sandbox CA, for the principal exec certificates name (the instance id). Added when served,
/// as the CA is configuration, not part of the log.
fn with_ssh_ca(
    mut spec: NodeSpec,
    ca: Option<&vps_commands::sandboxes::exec::ca::SandboxCa>,
) -> NodeSpec {
    let Some(ca) = ca else {
        return spec;
    };
    for instance in &mut spec.instances {
        if instance.ssh_from_host_only == Some(true) {
            instance.ssh_ca = Some(SshCa {
                public_key: ca.public_key().to_string(),
                principal: instance.id.clone(),
            });
        }
    }
    spec
}

/// How long a poll trusts its node's signals before reading the generation again (a lost
/// notification delays an answer at most this much).
const RECHECK: Duration = Duration::from_secs(1);

/// Replaces every `objectKey` the stored spec names with a URL signed now: an upload URL
/// (and its headers) on each snapshot command, a download URL on each `restoreFrom` and on
/// each image kept in the store (`store://…`). Signed
/// when served, so a URL never outlives its use by much and never sits in a table.
async fn sign_objects(
    store: &vps_store::SnapshotStore,
    mut spec: NodeSpec,
    ttl: Duration,
) -> Result<NodeSpec, ApiError> {
    let unsigned = |e: vps_store::StoreError| crate::error::internal(&e);
    for command in &mut spec.commands {
        let Some(key) = command.object_key.take() else {
            continue;
        };
        let upload = store.upload(&key, ttl).await.map_err(unsigned)?;
        command.upload_url = Some(upload.url);
        command.upload_headers = Some(upload.headers);
    }
    for instance in &mut spec.instances {
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
            continue;
        };
        let Some(key) = restore.object_key.take() else {
            continue;
        };
        restore.url = Some(store.download(&key, ttl).await.map_err(unsigned)?);
    }
    Ok(spec)
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
