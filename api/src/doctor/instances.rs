//! `vps.instances.deleting`: instances stuck in `deleting`.

use sqlx::PgPool;

use super::{age, count, some_ids, Finding, Severity};

/// The check.
pub const DELETING: &str = "vps.instances.deleting";

/// An instance `deleting` with no change for this long is stuck.
const STUCK: f64 = 600.0;

/// Instances `deleting` for over ten minutes: their host must report them gone (or be
/// declared lost), or their provider must finish the delete.
pub async fn deleting(pool: &PgPool) -> Result<Finding, sqlx::Error> {
    let (stuck, ids, oldest) =
        vps_projections::instances::reads::stuck_deleting(pool, STUCK).await?;
    if stuck == 0 {
        return Ok(Finding::ok(
            DELETING,
            format!("no instance deleting for over {}", age(STUCK)),
        ));
    }
    Ok(Finding::bad(
        DELETING,
        Severity::Warning,
        format!(
            "{} deleting for over {} (the oldest {}): {}",
            count(stuck, "instance", "instances"),
            age(STUCK),
            age(oldest.unwrap_or(0.0)),
            some_ids(&ids, stuck)
        ),
        "`vps history <id>` shows where each stopped: a hosted one waits for its host to \
         report it gone (or for the node to be lost), a provider one for the provider's delete",
    ))
}
