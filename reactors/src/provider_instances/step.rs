//! The provider reconciler's decisions, pure: no I/O, no clock, no randomness. A pass runs
//!
//! 1. [`plan`]: from the instance, its work item's retry time, `now` and the delays, what to do
//!    (wait, record something, or make a call);
//! 2. for a call, [`prepare`]: from the account and flavor facts the pass read, the provider
//!    configuration and the finished request (or what to record instead);
//! 3. the call itself (async, no transaction open), then [`commands_for`]: what its answer
//!    means for the instance;
//! 4. after recording them, [`answered`] (or [`recorded`] for a pass without a call): when to
//!    look again, the retry time to keep, and what to note on the account.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::Value;
use vps_domain::condition::ConditionType;
use vps_domain::instance::{AddressMode, Failure, Instance, InstanceCommand, Observed};
use vps_domain::state_table::{DesiredState, InstanceState};

use crate::providers::{
    CreateMachine, Machine, MachineState, ProviderConfig, ProviderError, ProviderErrorCode,
};
use crate::timings::Timings;
use crate::work_queue::Next;

/// What a pass does first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// No call and nothing to record: look again then.
    Wait(Next),
    /// No call, but something to record (a machine-less teardown, a broken account).
    Record(Vec<InstanceCommand>),
    /// A provider call, once the account is read ([`prepare`]).
    Call(Call),
}

/// The provider call a pass makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// Create the machine (idempotent by the instance id).
    Create(CreateMachine),
    /// Delete the machine.
    Delete(String),
    /// Read the machine, power it towards `desired` if it is elsewhere, and read it again.
    Look { id: String, desired: DesiredState },
}

/// What the provider answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The machine as it is now.
    Machine(Machine),
    /// A `get` or `power` found no machine: it was removed behind our back.
    Gone,
    /// The machine is deleted (or there was nothing to delete).
    Deleted,
    /// The call failed.
    Failed(ProviderError),
}

/// What a call needs from the database, read with no call made yet.
#[derive(Debug, Clone, PartialEq)]
pub struct CallFacts {
    /// The pool's provider account.
    pub account: Account,
    /// A create's flavor `offerId` (`None`: no such flavor, or it has none).
    pub offer_id: Option<String>,
    /// A create's user data, opened.
    pub user_data: Option<String>,
}

/// The pool's provider account as read.
#[derive(Debug, Clone, PartialEq)]
pub enum Account {
    /// The pool names no account.
    Unset,
    /// The pool names this account, which does not exist.
    Missing(String),
    /// The account.
    Found {
        /// Its id.
        id: String,
        /// `hetzner-cloud`, `proxmox` or `emulator`.
        provider: String,
        /// It has a `lastError` to clear once a call succeeds.
        has_error: bool,
        /// Its whole configuration, credentials opened; `None` when they do not open under
        /// this server's key.
        config: Option<Value>,
    },
}

/// A call ready to make, or what to record instead.
#[derive(Debug, Clone, PartialEq)]
pub enum Prepared {
    /// Nothing to call: a configuration fault to record.
    Record(Vec<InstanceCommand>),
    /// The call, with what it needs.
    Call(Box<Planned>),
}

/// A call ready to make.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// The provider to build for it.
    pub config: ProviderConfig,
    /// The account it goes through.
    pub account_id: String,
    /// The account has a `lastError` to clear once a call succeeds.
    pub account_has_error: bool,
    /// The call.
    pub call: Call,
}

/// How a pass with a call ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// When to look again.
    pub next: Next,
    /// The earliest time to call again, kept on the work item.
    pub retry_at: Option<DateTime<Utc>>,
    /// What to note on the account.
    pub account: AccountChange,
}

/// What a call's answer means for its account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountChange {
    /// Nothing.
    Keep,
    /// The provider refused the account's configuration: record it as its `lastError`.
    Record(ProviderError),
    /// A call succeeded: clear its `lastError`.
    Clear,
}

/// What a pass does first, before anything is read. `retry_at` is the work item's.
pub fn plan(
    inst: &Instance,
    retry_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Plan {
    if let Some(wait) = retry_wait(inst, retry_at, now, timings) {
        // A failed call asked us to wait (our own condition event woke us early).
        return Plan::Wait(Next::After(wait));
    }
    Plan::Call(match (inst.state, inst.external_id.clone()) {
        (InstanceState::Deleted | InstanceState::Error, _) => return Plan::Wait(Next::WhenWoken),
        // `get` would find nothing again; only a delete moves a lost machine on.
        (InstanceState::Lost, _) => return Plan::Wait(Next::After(timings.lost_look())),
        (InstanceState::Deleting, None) => return Plan::Record(vec![InstanceCommand::Release]),
        (InstanceState::Deleting, Some(id)) => Call::Delete(id),
        (InstanceState::Scheduling, None) => Call::Create(CreateMachine {
            idempotency_key: inst.id.clone(),
            name: inst.id.clone(),
            offer_id: String::new(),
            image_id: inst.image_id.clone(),
            user_data: None,
        }),
        (_, Some(id)) => Call::Look {
            id,
            desired: inst.desired_state,
        },
        (_, None) => return Plan::Wait(Next::After(timings.transitional_look())),
    })
}

/// How long to hold off calling, when a failed call asked for a wait that has not passed.
///
/// Recording a `ProviderError` condition is an instance event, and every instance event wakes
/// the instance, so without this the retry would come at once. The work item's retry time
/// honours `Retry-After`; the condition's own time covers an item recorded without one.
fn retry_wait(
    inst: &Instance,
    retry_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Option<Duration> {
    if matches!(
        inst.state,
        InstanceState::Error | InstanceState::Deleted | InstanceState::Lost
    ) {
        return None;
    }
    let remembered = retry_at.and_then(|at| (at - now).to_std().ok());
    let recorded = inst
        .condition(ConditionType::ProviderError)
        .and_then(|_| {
            let until = inst.updated_at + TimeDelta::from_std(timings.provider_retry()).ok()?;
            (until - now).to_std().ok()
        })
        .filter(|wait| !wait.is_zero());
    match (remembered, recorded) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// Readies `call` from the account and flavor facts, or says what to record instead.
pub fn prepare(inst: &Instance, call: Call, facts: CallFacts) -> Prepared {
    let (account_id, provider, has_error, config) = match facts.account {
        Account::Unset => {
            return broken_account(format!("pool {} has no provider account", inst.pool_id))
        }
        Account::Missing(id) => {
            return broken_account(format!("provider account {id} does not exist"))
        }
        Account::Found {
            id,
            provider,
            has_error,
            config,
        } => (id, provider, has_error, config),
    };
    let Some(config) = config else {
        // Not the account's fault: the server runs with another sealing key. Restarting it with
        // the right `[secrets] key` heals this, so it is retried rather than failed.
        return Prepared::Record(vec![InstanceCommand::SetCondition {
            condition_type: ConditionType::ProviderError,
            reason: ProviderErrorCode::InvalidConfig.as_str().into(),
            message: format!(
                "the credentials of provider account {account_id} do not open under this server's [secrets] key"
            ),
        }]);
    };
    let config = match ProviderConfig::parse(&provider, &config) {
        Ok(config) => config,
        Err(e) => return broken_account(format!("provider account {account_id}: {e}")),
    };
    let call = match call {
        Call::Create(mut request) => {
            let Some(offer_id) = facts.offer_id else {
                return broken_account(format!(
                    "flavor {} of pool {} has no offerId",
                    inst.flavor, inst.pool_id
                ));
            };
            request.offer_id = offer_id;
            request.user_data = facts.user_data;
            Call::Create(request)
        }
        other => other,
    };
    Prepared::Call(Box::new(Planned {
        config,
        account_id,
        account_has_error: has_error,
        call,
    }))
}

/// A configuration fault no retry will fix: the instance fails with `INVALID_CONFIG`.
fn broken_account(message: String) -> Prepared {
    Prepared::Record(vec![InstanceCommand::Fail(Failure::Provider {
        code: ProviderErrorCode::InvalidConfig.as_str().into(),
        message,
    })])
}

/// What the answer means for the instance, as commands (refusals of the state table are
/// skipped by `vps_commands::pipeline::apply_commands`).
pub fn commands_for(inst: &Instance, call: &Call, answer: &Answer) -> Vec<InstanceCommand> {
    match answer {
        Answer::Machine(machine) => {
            let mut commands = vec![
                match call {
                    Call::Create(_) => InstanceCommand::Provisioned {
                        external_id: machine.id.clone(),
                        addresses: machine.addresses.clone(),
                    },
                    _ => InstanceCommand::RecordAddresses {
                        addresses: machine.addresses.clone(),
                        mode: AddressMode::Replace,
                    },
                },
                InstanceCommand::ClearCondition(ConditionType::ProviderError),
            ];
            match machine.state {
                MachineState::Running => commands.push(InstanceCommand::Observe(Observed::Running)),
                MachineState::Stopped => commands.push(InstanceCommand::Observe(Observed::Stopped)),
                MachineState::Error => commands.push(InstanceCommand::Fail(Failure::Runtime {
                    message: format!(
                        "the provider reports machine {} of instance {} in error",
                        machine.id, inst.id
                    ),
                })),
                MachineState::Starting => {}
            }
            commands
        }
        Answer::Gone => vec![InstanceCommand::Lose],
        Answer::Deleted => vec![InstanceCommand::Release],
        Answer::Failed(error) if error.is_terminal() => {
            vec![InstanceCommand::Fail(Failure::Provider {
                code: error.code.as_str().into(),
                message: error.message.clone(),
            })]
        }
        Answer::Failed(error) => vec![InstanceCommand::SetCondition {
            condition_type: ConditionType::ProviderError,
            reason: error.code.as_str().into(),
            message: error.message.clone(),
        }],
    }
}

/// When to look again after a pass without a call recorded `commands`; `after` is the instance
/// as they left it (`None`: it had moved on, nothing was recorded).
pub fn recorded(commands: &[InstanceCommand], after: Option<&Instance>, timings: &Timings) -> Next {
    match (after, commands) {
        (None, _) => Next::After(Duration::ZERO),
        (Some(_), [InstanceCommand::SetCondition { .. }]) => Next::After(timings.provider_retry()),
        (Some(after), _) => next_look(timings, after),
    }
}

/// How a pass with a call ends, once its commands are recorded (`after`: the instance as they
/// left it; `None`: it had moved on, nothing was recorded). `retry_at` is the item's so far.
pub fn answered(
    planned: &Planned,
    answer: &Answer,
    after: Option<&Instance>,
    retry_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Outcome {
    let Some(after) = after else {
        return Outcome {
            next: Next::After(Duration::ZERO),
            retry_at,
            account: AccountChange::Keep,
        };
    };
    let Answer::Failed(error) = answer else {
        return Outcome {
            next: next_look(timings, after),
            retry_at: None,
            account: if planned.account_has_error {
                AccountChange::Clear
            } else {
                AccountChange::Keep
            },
        };
    };
    let account = match error.code {
        ProviderErrorCode::InvalidConfig => AccountChange::Record(error.clone()),
        _ => AccountChange::Keep,
    };
    if error.is_terminal() && after.state == InstanceState::Error {
        return Outcome {
            next: Next::WhenWoken,
            retry_at,
            account,
        };
    }
    let wait = timings
        .provider_retry()
        .max(error.retry_after.unwrap_or_default());
    Outcome {
        next: Next::After(wait),
        retry_at: TimeDelta::from_std(wait)
            .ok()
            .and_then(|wait| now.checked_add_signed(wait)),
        account,
    }
}

/// Whether a machine created for `current` is unwanted: the instance moved on while the create
/// was answered, is being deleted, and never learnt of the machine (nothing else would ever
/// delete it).
pub fn unwanted(current: &Instance) -> bool {
    current.external_id.is_none()
        && (current.desired_state == DesiredState::Deleted
            || matches!(
                current.state,
                InstanceState::Deleting | InstanceState::Deleted
            ))
}

/// When to look at an instance again, from where it stands.
fn next_look(timings: &Timings, inst: &Instance) -> Next {
    match inst.state {
        InstanceState::Deleted | InstanceState::Error => Next::WhenWoken,
        InstanceState::Lost => Next::After(timings.lost_look()),
        state if state == inst.desired_state.as_state() => Next::After(timings.provider_poll()),
        _ => Next::After(timings.transitional_look()),
    }
}

#[cfg(test)]
mod tests;
