//! NodeSpecs: per node, every live instance placed on it, as the host must run it. The
//! generation moves only when the content does, so hosts can long-poll for a change.
//!
//! Rebuilt inline after every instance event that touches a node, from the instance views,
//! images and pools as they stand at that event (so a replay rebuilds the same generations).

use serde_json::{json, Value};
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::instance::Instance;

use crate::ProjectionError;

/// The bridge hosted instances' NICs attach to.
pub const BRIDGE: &str = "br0";

/// Recomputes a node's spec and bumps its generation if the content changed.
pub async fn refresh(conn: &mut PgConnection, node_id: &str) -> Result<(), ProjectionError> {
    // Lock the node's spec row before reading the instances: a concurrent transaction that
    // changed another instance on this node has then committed, and the read below (a new
    // statement) sees it. Reading first could write a spec that misses that change.
    sqlx::query(
        "INSERT INTO node_specs (node_id, generation, spec) VALUES ($1, 0, '{}')
         ON CONFLICT (node_id) DO NOTHING",
    )
    .bind(node_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query("SELECT 1 FROM node_specs WHERE node_id = $1 FOR UPDATE")
        .bind(node_id)
        .execute(&mut *conn)
        .await?;
    let rows = sqlx::query(
        "SELECT i.doc, p.runtime, p.ip_cidr, im.url, im.sha256, im.format
           FROM instances i
           JOIN pools p ON p.id = i.pool_id
           LEFT JOIN images im ON im.id = (i.doc->>'imageId')
          WHERE i.node_id = $1 AND i.state NOT IN ('pending', 'scheduling', 'deleted')
          ORDER BY i.id",
    )
    .bind(node_id)
    .fetch_all(&mut *conn)
    .await?;
    let entries: Vec<Value> = rows
        .iter()
        .map(|r| {
            let Json(inst): Json<Instance> = r.get(0);
            let prefix = r
                .get::<Option<String>, _>(2)
                .and_then(|c| c.split_once('/').map(|(_, p)| p.to_string()))
                .unwrap_or_else(|| "32".into());
            entry(&inst, r.get(1), &prefix, (r.get(3), r.get(4), r.get(5)))
        })
        .collect();
    let spec = json!({ "nodeId": node_id, "instances": entries });
    sqlx::query(
        "UPDATE node_specs SET generation = generation + 1, spec = $2
          WHERE node_id = $1 AND spec IS DISTINCT FROM $2",
    )
    .bind(node_id)
    .bind(Json(&spec))
    .execute(conn)
    .await?;
    Ok(())
}

fn entry(
    inst: &Instance,
    runtime: Option<String>,
    prefix: &str,
    image: (Option<String>, Option<String>, Option<String>),
) -> Value {
    let gpus = inst
        .shape
        .gpus
        .iter()
        .map(|g| json!({ "model": g.model, "count": g.count }))
        .collect::<Vec<_>>();
    json!({
        "id": inst.id,
        "desiredState": inst.desired_state,
        "runtime": runtime,
        "shape": inst.shape,
        "image": { "url": image.0, "sha256": image.1, "format": image.2 },
        "userDataRef": inst.user_data_ref,
        "allocationId": inst.allocation_id,
        "gpus": gpus,
        "nics": inst.addresses.first().map(|a| vec![json!({
            "bridge": BRIDGE,
            "mac": vps_domain::ids::mac_for(&inst.id),
            "address": format!("{a}/{prefix}"),
        })]).unwrap_or_default(),
    })
}

/// A node's spec with its generation (an empty spec at generation 0 before any instance).
pub async fn load(conn: &mut PgConnection, node_id: &str) -> Result<Value, sqlx::Error> {
    let row = sqlx::query("SELECT generation, spec FROM node_specs WHERE node_id = $1")
        .bind(node_id)
        .fetch_optional(conn)
        .await?;
    Ok(match row {
        Some(r) => {
            let mut spec: Value = r.get(1);
            spec["generation"] = json!(r.get::<i64, _>(0));
            spec
        }
        None => json!({ "nodeId": node_id, "generation": 0, "instances": [] }),
    })
}
