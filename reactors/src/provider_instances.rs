//! The instance reconciler's provider path (plan → call → apply).

use vps_commands::{CommandError, Ctx};
use vps_domain::instance::Instance;

use crate::timings::Timings;
use crate::work_queue::Next;

/// One pass over a provider instance.
pub async fn reconcile(
    _ctx: &Ctx,
    timings: &Timings,
    _inst: Instance,
) -> Result<Next, CommandError> {
    Ok(Next::After(timings.provider_poll))
}
