//! What templates and sandboxes take from volumes: a template's mounts resolved to the
//! tenant's volumes when it is written, and a sandbox's attachments when it is created, under
//! the one-writer rule. Both lock the volumes' rows (in id order), so a volume delete, which
//! locks its row too, never races a template or a sandbox starting to use it.

use std::collections::BTreeMap;

use sqlx::PgConnection;
use vps_domain::template::Template;
use vps_domain::volume::{
    attach as attachments, check_mount_paths, resolve, Attachment, TemplateVolume, VolumeMount,
};

use crate::error::CommandError;

/// Resolves a template's `mounts` (in `pool_id`) to the tenant's volumes: the paths checked
/// first, then each name to a `ready` volume of the pool, all on one node. The volumes are
/// held (`FOR SHARE`) until the template is written.
pub async fn resolve_mounts(
    tx: &mut PgConnection,
    tenant_id: &str,
    pool_id: &str,
    mounts: &[VolumeMount],
) -> Result<Vec<TemplateVolume>, CommandError> {
    let paths: Vec<&str> = mounts.iter().map(|m| m.mount_path.as_str()).collect();
    check_mount_paths(&paths)?;
    let names: Vec<&str> = mounts.iter().map(|m| m.name.as_str()).collect();
    let found = vps_projections::volumes::named_for_share(tx, tenant_id, &names).await?;
    Ok(resolve(pool_id, mounts, &found)?)
}

/// The attachments a new sandbox's instance gets from template `t` (none without volumes).
/// The volumes are locked to the transaction's end, so concurrent sandboxes of one volume are
/// decided one after the other and a second writer is refused (`CONFLICT`, `volume-in-use`).
pub async fn attach(tx: &mut PgConnection, t: &Template) -> Result<Vec<Attachment>, CommandError> {
    if t.spec.volumes.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<String> = t.spec.volumes.iter().map(|m| m.volume_id.clone()).collect();
    let volumes = vps_projections::volumes::lock_many(tx, &ids).await?;
    let live: BTreeMap<String, Vec<bool>> = vps_projections::volumes::attachments(tx, &ids)
        .await?
        .into_iter()
        .map(|(volume, held)| (volume, held.into_iter().map(|(_, ro)| ro).collect()))
        .collect();
    Ok(attachments(&t.spec.volumes, &volumes, &live)?)
}
