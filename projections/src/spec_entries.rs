//! Spec entry tables: one row per (node, key) holding what a host must keep (an instance, a
//! volume), written as a diff so a node's generation moves only when an entry of it changes.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use sqlx::PgConnection;

use crate::ProjectionError;

/// A table of spec entries: one row per (node, key), the key naming an instance or a volume.
pub(crate) struct EntryTable {
    /// The table.
    pub table: &'static str,
    /// Its key column besides `node_id`.
    pub key: &'static str,
}

/// The condition that selects the rows of parameter `$1`'s ids (column `id`) or, with a node,
/// also every row of parameter `$2`'s node (column `node`). Without a node it names only the
/// ids: the NodeSpec pass runs with kept plans ([`vps_pg::connect::BEGIN_KEYED`]), and a plan
/// kept for `id = ANY($1) OR node = $2` can read a whole index instead of the ids' rows (every
/// placed instance, 7,000 rows and 4 ms a pass, in `bench api`).
pub(crate) fn ids_or_node(id: &str, node_column: &str, node: Option<&str>) -> String {
    match node {
        None => format!("{id} = ANY($1)"),
        Some(_) => format!("({id} = ANY($1) OR {node_column} = $2)"),
    }
}

/// The entries of `t` stored now for `ids` (or, with `node`, every entry of it).
async fn stored(
    conn: &mut PgConnection,
    t: &EntryTable,
    ids: &[String],
    node: Option<&str>,
) -> Result<BTreeMap<(String, String), Value>, ProjectionError> {
    let rows: Vec<(String, String, Value)> = sqlx::query_as(&format!(
        "SELECT node_id, {key}, entry FROM {table} WHERE {which}",
        key = t.key,
        table = t.table,
        which = ids_or_node(t.key, "node_id", node),
    ))
    .bind(ids)
    .bind(node)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.into_iter().map(|(n, i, e)| ((n, i), e)).collect())
}

/// The nodes whose generation a write moved, each with its new generation.
pub type Moved = Vec<(String, i64)>;

/// Makes the stored entries of `t` for `ids` (or of `node`) `want`, and moves the generation
/// of every node an entry of which changed; answers those.
pub(crate) async fn write(
    conn: &mut PgConnection,
    t: &EntryTable,
    ids: &[String],
    node: Option<&str>,
    want: BTreeMap<(String, String), Value>,
) -> Result<Moved, ProjectionError> {
    let have = stored(conn, t, ids, node).await?;
    let gone: Vec<&(String, String)> = have.keys().filter(|k| !want.contains_key(*k)).collect();
    let set: Vec<(&(String, String), &Value)> = want
        .iter()
        .filter(|(k, v)| have.get(*k) != Some(*v))
        .collect();
    let changed: BTreeSet<&String> = gone
        .iter()
        .map(|k| &k.0)
        .chain(set.iter().map(|(k, _)| &k.0))
        .collect();
    if changed.is_empty() {
        return Ok(Moved::new());
    }
    // One statement: the generations move, and each entry written carries the one that
    // publishes it (the keys deleted and the keys set never overlap).
    let moved = sqlx::query_as(&format!(
        "WITH moved AS ({BUMP}),
         gone AS (
           DELETE FROM {table} e USING unnest($2::text[], $3::text[]) AS g(node_id, k)
            WHERE e.node_id = g.node_id AND e.{key} = g.k
         ), written AS (
           INSERT INTO {table} (node_id, {key}, entry, generation)
           SELECT s.node_id, s.k, s.entry, m.generation
             FROM unnest($4::text[], $5::text[], $6::jsonb[]) AS s(node_id, k, entry)
             JOIN moved m ON m.node_id = s.node_id
           ON CONFLICT (node_id, {key})
              DO UPDATE SET entry = excluded.entry, generation = excluded.generation
         )
         SELECT node_id, generation FROM moved",
        key = t.key,
        table = t.table,
    ))
    .bind(changed.into_iter().collect::<Vec<_>>())
    .bind(gone.iter().map(|k| k.0.as_str()).collect::<Vec<_>>())
    .bind(gone.iter().map(|k| k.1.as_str()).collect::<Vec<_>>())
    .bind(set.iter().map(|(k, _)| k.0.as_str()).collect::<Vec<_>>())
    .bind(set.iter().map(|(k, _)| k.1.as_str()).collect::<Vec<_>>())
    .bind(set.iter().map(|(_, v)| *v).collect::<Vec<_>>())
    .fetch_all(&mut *conn)
    .await?;
    Ok(moved)
}

/// Moves the generation of `$1`'s nodes, answering each node's new one.
const BUMP: &str = "INSERT INTO node_specs (node_id, generation) SELECT unnest($1::text[]), 1
         ON CONFLICT (node_id) DO UPDATE SET generation = node_specs.generation + 1
         RETURNING node_id, generation";

/// Moves the generation of `nodes` (an entry or a host command of theirs changed); answers
/// each node's new generation.
pub(crate) async fn bump(conn: &mut PgConnection, nodes: &[String]) -> Result<Moved, sqlx::Error> {
    sqlx::query_as(BUMP).bind(nodes).fetch_all(conn).await
}
