//! `nodes.register`, `nodes.cordon` and `nodes.uncordon`.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use vps_domain::node::{decide, Node, NodeCommand};
use vps_domain::pool::Pool;
use vps_domain::resources::Capacity;
use vps_projections::operator_views::{self as views, NodeView};

use super::name_taken;
use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{change, load, transaction};
use crate::record::new_id;
use vps_domain::ids::PoolId;

/// `nodes.register`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterNode {
    /// A hosted pool.
    pub pool_id: PoolId,
    /// Unique in the pool.
    pub name: String,
    /// What it offers.
    pub capacity: Capacity,
    /// Placement labels: at most 64.
    #[serde(default, deserialize_with = "vps_domain::bounds::map::<_, String, 64>")]
    #[schemars(extend("maxProperties" = 64))]
    pub labels: BTreeMap<String, String>,
    /// Runtimes it advertises (default: the pool's): at most 16.
    #[serde(
        default,
        deserialize_with = "vps_domain::bounds::optional_list::<_, String, 16>"
    )]
    #[schemars(length(max = 16))]
    pub runtimes: Option<Vec<String>>,
    /// CPU model.
    pub cpu_model: Option<String>,
}

/// `nodes.register`'s answer.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RegisteredNode {
    /// The node.
    pub node: NodeView,
    /// Its token: shown once, stored only as a hash.
    pub node_token: String,
}

/// `nodes.rotateToken`'s answer.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RotatedToken {
    /// The node.
    pub node_id: String,
    /// Its new token: shown once; the old one is refused from now on.
    pub node_token: String,
}

/// Registers a node; answers the node and its token (shown once, stored only as a hash).
pub async fn register_node(ctx: &Ctx, input: RegisterNode) -> Result<RegisteredNode, CommandError> {
    let id = new_id("node");
    let token = new_token();
    let node = transaction(ctx, &id, async |tx| {
        let pool = load::<Pool>(tx, &input.pool_id).await?;
        let register = vps_domain::node::RegisterNode {
            id: id.clone(),
            pool_id: input.pool_id.to_string(),
            name: input.name.clone(),
            capacity: input.capacity.clone(),
            labels: input.labels.clone(),
            runtimes: input.runtimes.clone(),
            cpu_model: input.cpu_model.clone(),
            pool: pool.map(|p| (p.class, p.runtime)),
            name_taken: name_taken(tx, "nodes", Some(&input.pool_id), &input.name, None).await?,
        };
        let command = NodeCommand::Register(Box::new(register));
        change::<Node>(ctx, tx, &id, None, |n| decide(n, &command)).await?;
        store_token(tx, &id, &token).await?;
        view(tx, &id).await
    })
    .await?;
    Ok(RegisteredNode {
        node,
        node_token: token,
    })
}

/// Replaces a node's token (`node.tokenRotated` names no token); answers the new one, shown
/// once. The old token is refused from the commit on.
pub async fn rotate_token(ctx: &Ctx, node_id: &str) -> Result<RotatedToken, CommandError> {
    let token = new_token();
    transaction(ctx, node_id, async |tx| {
        change::<Node>(ctx, tx, node_id, None, |n| {
            decide(n, &NodeCommand::RotateToken)
        })
        .await?;
        store_token(tx, node_id, &token).await?;
        Ok(())
    })
    .await?;
    Ok(RotatedToken {
        node_id: node_id.to_string(),
        node_token: token,
    })
}

fn new_token() -> String {
    format!(
        "nt_{}",
        data_encoding::HEXLOWER.encode(&rand::random::<[u8; 24]>())
    )
}

/// Keeps a token's hash beside the log (never in it), replacing the node's previous one.
async fn store_token(
    tx: &mut sqlx::PgConnection,
    node_id: &str,
    token: &str,
) -> Result<(), CommandError> {
    sqlx::query(
        "INSERT INTO node_tokens (node_id, token_hash) VALUES ($1, $2)
         ON CONFLICT (node_id) DO UPDATE SET token_hash = $2, rotated_at = now()",
    )
    .bind(node_id)
    .bind(token_hash(token))
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The stored form of a node token.
pub fn token_hash(token: &str) -> String {
    data_encoding::HEXLOWER.encode(&Sha256::digest(token.as_bytes()))
}

/// Cordons (`true`) or uncordons a node.
pub async fn set_cordon(ctx: &Ctx, node_id: &str, cordon: bool) -> Result<NodeView, CommandError> {
    let command = if cordon {
        NodeCommand::Cordon
    } else {
        NodeCommand::Uncordon
    };
    transaction(ctx, node_id, async |tx| {
        change::<Node>(ctx, tx, node_id, None, |n| decide(n, &command)).await?;
        view(tx, node_id).await
    })
    .await
}

async fn view(tx: &mut sqlx::PgConnection, node_id: &str) -> Result<NodeView, CommandError> {
    views::node(&mut *tx, node_id)
        .await?
        .ok_or_else(|| CommandError::not_found(format!("node {node_id}")))
}
