//! The end of a volume's deletion: a `deleting` volume has left its node's spec, but its disk
//! stays booked until its host has applied a spec without it (the host's reported applied
//! generation has reached the node's current one) or the host is gone (`lost`, or no longer
//! registered). Then `sandbox.volume.deleted` releases the booking and the quota. Run by the
//! sandbox reconciler on each of its passes, so one worker across replicas does it.

use vps_commands::{volumes, CommandError, Ctx};

/// Most volumes released per pass.
pub const RELEASE_PER_PASS: i64 = 100;

/// Releases the deleting volumes whose host let them go; answers how many.
pub async fn release_deleted(ctx: &Ctx) -> Result<usize, CommandError> {
    // Absent from `node_spec_volumes`: the NodeSpec follower has taken it out of the spec, at
    // a generation no later than the node's current one.
    let due = vps_projections::volumes::releasable(&ctx.pool, RELEASE_PER_PASS).await?;
    let mut released = 0;
    for id in due {
        if volumes::release(ctx, &id).await? {
            released += 1;
        }
    }
    Ok(released)
}
