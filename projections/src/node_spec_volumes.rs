//! The volume part of NodeSpecs (`volumes: [{ id, sizeGiB, serial }]`): every volume booked
//! on the node that is not being deleted, so its host creates it (and grows it to its size).
//! A deleting volume leaves its node's spec, and the host destroys it. Kept by the NodeSpec
//! follower beside the instance entries ([`crate::node_specs`]), in the same transaction and
//! with the same generation.

use std::collections::BTreeMap;

use serde_json::Value;
use sqlx::PgConnection;
use vps_domain::volume::Attachment;

use crate::node_spec_payload::{NodeVolume, VolumeAttachment};
use crate::spec_entries::{write, EntryTable, Moved};
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
) -> Result<Moved, ProjectionError> {
    let rows: Vec<(String, String, i64, String)> = sqlx::query_as(&format!(
        "SELECT node_id, id, size_gib, doc->>'serial' FROM sandbox_volumes
          WHERE {} AND state IN ('creating', 'ready')",
        crate::spec_entries::ids_or_node("id", "node_id", node)
    ))
    .bind(ids)
    .bind(node)
    .fetch_all(&mut *conn)
    .await?;
    let want: BTreeMap<(String, String), Value> = rows
        .into_iter()
        .map(|(node, id, size, serial)| {
            let entry = NodeVolume {
                id: id.clone(),
                size_gib: size,
                serial,
            };
            let entry = serde_json::to_value(entry).expect("a volume entry serialises");
            ((node, id), entry)
        })
        .collect();
    write(conn, &ENTRIES, ids, node, want).await
}

/// What an `InstanceSpec` lists of the volumes it attaches.
pub(crate) fn attachments(volumes: &[Attachment]) -> Vec<VolumeAttachment> {
    volumes
        .iter()
        .map(|a| VolumeAttachment {
            volume_id: a.volume_id.clone(),
            serial: a.serial.clone(),
            mount_path: a.mount_path.clone(),
            read_only: a.read_only,
        })
        .collect()
}
