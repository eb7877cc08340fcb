//! The volume part of NodeSpecs (`volumes: [{ id, sizeGiB, serial }]`): every volume booked
//! on the node that is not being deleted, so its host creates it (and grows it to its size).
//! A deleting volume leaves its node's spec, and the host destroys it. Kept by the NodeSpec
//! follower beside the instance entries ([`crate::node_specs`]), in the same transaction and
//! with the same generation.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sqlx::PgConnection;
use vps_domain::volume::Attachment;

use crate::spec_entries::{write, EntryTable};
use crate::ProjectionError;

const ENTRIES: EntryTable = EntryTable {
    table: "node_spec_volumes",
    key: "volume_id",
};

/// Makes the volume entries of `ids` (or of `node`) what the volumes' rows call for.
pub(crate) async fn sync(
    conn: &mut PgConnection,
    ids: &[String],
    node: Option<&str>,
) -> Result<(), ProjectionError> {
    let rows: Vec<(String, String, i64, String)> = sqlx::query_as(
        "SELECT node_id, id, size_gib, doc->>'serial' FROM sandbox_volumes
          WHERE (id = ANY($1) OR node_id = $2) AND state IN ('creating', 'ready')",
    )
    .bind(ids)
    .bind(node)
    .fetch_all(&mut *conn)
    .await?;
    let want: BTreeMap<(String, String), Value> = rows
        .into_iter()
        .map(|(node, id, size, serial)| {
            let entry = json!({ "id": id, "sizeGiB": size, "serial": serial });
            ((node, id), entry)
        })
        .collect();
    write(conn, &ENTRIES, ids, node, want).await
}

/// What an `InstanceSpec` lists of the volumes it attaches.
pub(crate) fn attachments(volumes: &[Attachment]) -> Value {
    volumes
        .iter()
        .map(|a| {
            json!({
                "volumeId": a.volume_id,
                "serial": a.serial,
                "mountPath": a.mount_path,
                "readOnly": a.read_only,
            })
        })
        .collect()
}
