//! The sandbox reconciler's decision, pure: from a sandbox, its instance's state, the time and
//! the delays, the work a pass does for it. No I/O, no clock, no randomness: the pass reads the
//! [`Look`]s first and records the commands afterwards, each of which decides again on the
//! sandbox's locked row.

use chrono::{DateTime, TimeDelta, Utc};
use vps_domain::sandbox::{self as domain, Deadlines, Sandbox, SandboxState};
use vps_domain::state_table::InstanceState;

use crate::timings::Timings;

/// What a pass read about one sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct Look {
    /// The sandbox as its projection row holds it.
    pub sandbox: Sandbox,
    /// Its instance's state; `None` when the instance is gone.
    pub instance: Option<InstanceState>,
}

/// What a pass does for a sandbox, in the order a pass does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// Its expiry warning or its expiry is due (`lifecycle::expire`).
    Expire,
    /// It stood in `starting`, `pausing` or `resuming` past its deadline
    /// (`lifecycle::enforce_deadline`).
    FailPastDeadline,
    /// Its instance moved where the sandbox did not follow: the fallback for the instance
    /// path's own stamps (`lifecycle::settle`).
    Settle,
}

/// The work due on the sandbox of `look` at `now`, in the order it is done.
pub fn step(look: &Look, now: DateTime<Utc>, timings: &Timings) -> Vec<Action> {
    let s = &look.sandbox;
    let mut due = Vec::new();
    // The pause an expiry may turn into changes what it records, never whether it is due.
    let (lead, min_lead) = expiry_leads(timings);
    if !domain::expiry(s, now, lead, min_lead, None).is_empty() {
        due.push(Action::Expire);
    }
    if !domain::deadline(s, now, &deadlines(timings)).is_empty() {
        due.push(Action::FailPastDeadline);
    }
    if unsettled(s, look.instance) {
        due.push(Action::Settle);
    }
    due
}

/// Whether a pass over the sandbox of `look` could do anything at `now`.
pub fn wants_pass(look: &Look, now: DateTime<Utc>, timings: &Timings) -> bool {
    !step(look, now, timings).is_empty()
}

/// The expiry warning's lead and its floor.
pub fn expiry_leads(timings: &Timings) -> (TimeDelta, TimeDelta) {
    (
        delta(timings.sandbox_expiring_lead()),
        delta(timings.sandbox_expiring_min_lead()),
    )
}

/// The transitional states' deadlines.
pub fn deadlines(timings: &Timings) -> Deadlines {
    Deadlines {
        starting: delta(timings.deadline_sandbox_starting()),
        pausing: delta(timings.deadline_sandbox_pausing()),
        resuming: delta(timings.deadline_sandbox_resuming()),
    }
}

/// A sandbox whose instance runs while it is `starting` or `resuming`, one `pausing` whose
/// instance is paused, or one not deleted whose instance is gone (except one a deadline
/// failed: it stays `failed`, its instance released).
fn unsettled(s: &Sandbox, instance: Option<InstanceState>) -> bool {
    match instance {
        Some(InstanceState::Running) => {
            matches!(s.state, SandboxState::Starting | SandboxState::Resuming)
        }
        Some(InstanceState::Paused) => s.state == SandboxState::Pausing,
        None | Some(InstanceState::Deleted) => {
            s.state != SandboxState::Deleted && !s.failed_by_deadline()
        }
        Some(_) => false,
    }
}

/// A delay as a [`TimeDelta`] (one beyond its range: forever).
pub fn delta(d: std::time::Duration) -> TimeDelta {
    TimeDelta::from_std(d).unwrap_or(TimeDelta::MAX)
}

#[cfg(test)]
mod tests;
