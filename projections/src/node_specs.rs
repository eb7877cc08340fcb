//! NodeSpecs: per node, every live instance placed on it, as the host must run it. The
//! generation moves only when the content does, so hosts can long-poll for a change.
//!
//! An async projector: a follower (`run`) refreshes the nodes a batch of events touched, from
//! the instance views as they stand, in one transaction with its checkpoint. Commands never
//! wait for it, and one refresh covers every change a batch made to a node. The content is a
//! function of the views (a replay compares it); the generation counts the refreshes that
//! changed it, so it is not compared.

use serde_json::{json, Value};
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::instance::Instance;

use crate::ProjectionError;

/// The bridge hosted instances' NICs attach to.
pub const BRIDGE: &str = "br0";

/// Recomputes a node's spec and bumps its generation if the content changed.
pub async fn refresh(conn: &mut PgConnection, node_id: &str) -> Result<(), ProjectionError> {
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
        "INSERT INTO node_specs (node_id, generation, spec)
         VALUES ($1, CASE WHEN jsonb_array_length($2::jsonb->'instances') = 0 THEN 0 ELSE 1 END, $2)
         ON CONFLICT (node_id) DO UPDATE SET generation = node_specs.generation + 1, spec = excluded.spec
          WHERE node_specs.spec IS DISTINCT FROM excluded.spec",
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

/// The follower's (and lease's) name.
pub const FOLLOWER: &str = "node-specs";

/// Nodes whose spec a batch may have changed: the nodes its events name, and the nodes whose
/// spec lists an instance of the batch (an instance moved off or deleted names none).
async fn touched(
    conn: &mut PgConnection,
    batch: &[vps_events::RecordedEvent],
) -> Result<Vec<String>, sqlx::Error> {
    let mut nodes: Vec<String> = Vec::new();
    let mut instances: Vec<String> = Vec::new();
    for e in batch {
        for key in ["nodeId", "fromNodeId"] {
            if let Some(n) = e.data[key].as_str() {
                nodes.push(n.to_string());
            }
        }
        if e.event_type.starts_with("instance.") {
            if let Some(i) = e.data["instanceId"].as_str() {
                instances.push(i.to_string());
            }
        }
        if e.event_type.starts_with("image.") || e.event_type == "pool.ip_range.set" {
            // Rare, and they change every spec that shows them: refresh all.
            let all: Vec<String> = sqlx::query_scalar("SELECT node_id FROM node_specs")
                .fetch_all(&mut *conn)
                .await?;
            nodes.extend(all);
        }
    }
    if !instances.is_empty() {
        let listing: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT s.node_id FROM node_specs s, jsonb_array_elements(s.spec->'instances') e
              WHERE e->>'id' = ANY($1)",
        )
        .bind(&instances)
        .fetch_all(&mut *conn)
        .await?;
        nodes.extend(listing);
        let placed: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT node_id FROM instances WHERE id = ANY($1) AND node_id IS NOT NULL",
        )
        .bind(&instances)
        .fetch_all(&mut *conn)
        .await?;
        nodes.extend(placed);
    }
    nodes.sort();
    nodes.dedup();
    Ok(nodes)
}

/// Refreshes the specs a batch touched and moves the checkpoint, in one transaction.
pub async fn apply_batch(
    pool: &sqlx::PgPool,
    follower: &mut vps_events::Follower,
    batch: &[vps_events::RecordedEvent],
) -> Result<(), ProjectionError> {
    let Some(last) = batch.last().map(vps_events::RecordedEvent::cursor) else {
        return Ok(());
    };
    let mut tx = pool.begin().await?;
    for node in touched(&mut tx, batch).await? {
        refresh(&mut tx, &node).await?;
    }
    vps_events::follower::save_checkpoint(&mut *tx, FOLLOWER, last).await?;
    tx.commit().await?;
    follower.advance(last);
    Ok(())
}

/// Runs the projector for as long as the task lives (one replica at a time).
pub async fn run(
    pool: sqlx::PgPool,
    notifier: vps_events::Notifier,
) -> Result<(), ProjectionError> {
    let _lease =
        vps_events::lease::Lease::acquire(&pool, FOLLOWER, std::time::Duration::from_secs(2)).await;
    let mut follower = vps_events::Follower::load(pool.clone(), FOLLOWER, &notifier).await?;
    loop {
        let batch = follower.next_batch(2000).await?;
        if batch.is_empty() {
            follower.report_lag().await?;
            follower.wait().await;
            continue;
        }
        apply_batch(&pool, &mut follower, &batch).await?;
        // Hosts long-polling their spec wait on this.
        notifier.committed();
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
    // Nodes without a live instance keep an empty spec; drop the rows a rebuild would not make.
    Ok(())
}
