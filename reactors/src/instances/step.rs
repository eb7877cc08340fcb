//! The hosted reconciler's decision, pure: from the instance, the facts the pass read, the time
//! and the delays, the command to record (if any) and when to look again. No I/O, no clock, no
//! randomness: the pass reads [`HostedFacts`] first and records the command afterwards.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use vps_domain::condition::ConditionType;
use vps_domain::instance::{Instance, InstanceCommand, RecreateCause};
use vps_domain::state_table::InstanceState;

use crate::timings::Timings;
use crate::work_queue::Next;

/// What a hosted pass read before deciding.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostedFacts {
    /// The pool's `recreateOnHostLoss` policy (read only for a lost instance).
    pub recreate_on_host_loss: bool,
    /// What placement chose for a `scheduling` instance (read only for one).
    pub placement: Option<Placement>,
    /// Whether the tenant has another running instance on the node whose refusal stands (see
    /// [`standing_refusal`]; read only when one stands).
    pub tenant_runs_there: bool,
}

/// What placement chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// A node and an address (`Place`), or why nothing fits (`MarkUnschedulable`).
    Decided(InstanceCommand),
    /// A node fits but the pool has no free address.
    NoAddress,
}

/// One hosted pass: the command to record, and when to look again.
pub fn step(
    inst: &Instance,
    facts: HostedFacts,
    now: DateTime<Utc>,
    timings: &Timings,
) -> (Option<InstanceCommand>, Next) {
    match inst.state {
        InstanceState::Scheduling => match facts.placement {
            Some(Placement::Decided(cmd @ InstanceCommand::Place(_))) => {
                (Some(cmd), Next::WhenWoken)
            }
            Some(Placement::Decided(cmd)) => {
                (Some(cmd), Next::After(timings.unschedulable_retry()))
            }
            // No free address: wait for one like for capacity.
            Some(Placement::NoAddress) | None => (None, Next::After(timings.unschedulable_retry())),
        },
        InstanceState::Lost => {
            if facts.recreate_on_host_loss
                && inst.desired_state.as_state() != InstanceState::Deleted
            {
                (
                    Some(InstanceCommand::Recreate(RecreateCause::HostLost)),
                    Next::After(Duration::ZERO),
                )
            } else {
                (None, Next::After(timings.lost_look()))
            }
        }
        InstanceState::Deleted | InstanceState::Error => (None, Next::WhenWoken),
        _ => exhausted_or_settled(inst, &facts, now, timings),
    }
}

/// The node whose `HostResourcesExhausted` refusal has stood for `replacement_wait` at `now`.
pub fn standing_refusal<'a>(
    inst: &'a Instance,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Option<&'a str> {
    inst.refusal_standing(now, replacement_wait(timings))
}

fn replacement_wait(timings: &Timings) -> TimeDelta {
    TimeDelta::from_std(timings.replacement_wait()).unwrap_or(TimeDelta::MAX)
}

/// A placed instance: re-place it away from a host that keeps refusing it, or look again
/// while it is still on its way.
fn exhausted_or_settled(
    inst: &Instance,
    facts: &HostedFacts,
    now: DateTime<Utc>,
    timings: &Timings,
) -> (Option<InstanceCommand>, Next) {
    if let Some(condition) = inst.condition(ConditionType::HostResourcesExhausted) {
        if standing_refusal(inst, now, timings).is_none() {
            let remaining = (condition.since + replacement_wait(timings) - now)
                .to_std()
                .unwrap_or(Duration::ZERO);
            return (None, Next::After(remaining));
        }
        // A tenant's running instance on that node means the refusal is the tenant's own
        // doing (its neighbours), not the host's: leave it there.
        if facts.tenant_runs_there {
            return (None, Next::After(timings.transitional_look()));
        }
        let exclude_until =
            now + TimeDelta::from_std(timings.refusing_node_exclusion()).unwrap_or(TimeDelta::MAX);
        return (
            Some(InstanceCommand::Recreate(
                RecreateCause::ResourcesExhausted { exclude_until },
            )),
            Next::After(Duration::ZERO),
        );
    }
    // Settled, or on its way: what comes next is the host's to report, and its report wakes
    // the item. A look in between could only find the same.
    (None, Next::WhenWoken)
}

/// Whether a pass over `inst` could do anything: record a command, or look again at a time
/// (capacity to wait for, a lost instance, a refusal that will come to stand). Otherwise only
/// a change to the instance can give a pass something to do, and that change wakes it again.
///
/// No facts are read for this: they are read only for a scheduling or lost instance or a
/// standing refusal, and there every answer does something, so they never make a pass idle.
pub fn wants_pass(inst: &Instance, now: DateTime<Utc>, timings: &Timings) -> bool {
    !matches!(
        step(inst, HostedFacts::default(), now, timings),
        (None, Next::WhenWoken)
    )
}

#[cfg(test)]
mod tests;
