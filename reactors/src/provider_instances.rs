//! The instance reconciler's provider path (SPEC §3.6): each pass **plans** in a short
//! transaction (the instance, its pool's account, the call to make), **calls** the provider
//! with no transaction open (the instance id is the idempotency key), then **applies** the
//! answer in a new transaction, only if the instance's stream version has not moved meanwhile;
//! otherwise it plans again at once.
//!
//! | instance | call |
//! | --- | --- |
//! | `scheduling`, no machine | `create` (flavor's `offerId`, image, sealed user data) |
//! | `deleting` with a machine | `delete` (`NOT_FOUND` counts as done) |
//! | any other live state with a machine | `get`, then `power` if the machine is not where `desiredState` wants it, then `get` |
//! | `deleted`, `error`, `lost` | none |
//!
//! A provider is built per pass from the account (cheap, no I/O; every `emulator` account
//! shares one in-process cloud).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use chrono::Utc;
use sqlx::Row;
use vps_commands::hosts::apply_all;
use vps_commands::provider_accounts as accounts;
use vps_commands::{CommandError, Ctx};
use vps_domain::condition::ConditionType;
use vps_domain::instance::{AddressMode, Failure, Instance, InstanceCommand, Observed};
use vps_domain::state_table::{DesiredState, InstanceState};
use vps_projections::instances::load;

use crate::providers::{
    build, CreateMachine, Machine, MachineState, Power, Provider, ProviderConfig, ProviderError,
    ProviderErrorCode,
};
use crate::timings::Timings;
use crate::work_queue::Next;

/// One pass over a provider instance.
pub async fn reconcile(ctx: &Ctx, timings: &Timings, inst: Instance) -> Result<Next, CommandError> {
    if let Some(wait) = retry_wait(timings, &inst) {
        // A failed call asked us to wait (our own condition event woke us early).
        return Ok(Next::After(wait));
    }
    let planned = match plan(ctx, timings, &inst).await? {
        Plan::Wait(next) => return Ok(next),
        Plan::Record(commands) => {
            return Ok(match apply(ctx, &inst, &commands).await? {
                Applied::Moved => Next::After(Duration::ZERO),
                Applied::Now(after) => match &commands[..] {
                    [InstanceCommand::SetCondition { .. }] => Next::After(timings.provider_retry),
                    _ => next_look(timings, &after),
                },
            });
        }
        Plan::Call(planned) => planned,
    };
    let answer = call(&*planned.provider, &planned.call).await;
    let commands = commands_for(&inst, &planned.call, &answer);
    let after = match apply(ctx, &inst, &commands).await? {
        Applied::Now(after) => after,
        Applied::Moved => {
            if let (Call::Create(_), Answer::Machine(machine)) = (&planned.call, &answer) {
                drop_if_unwanted(ctx, &*planned.provider, &inst.id, machine).await?;
            }
            return Ok(Next::After(Duration::ZERO));
        }
    };
    let next = match &answer {
        Answer::Failed(error) => {
            if error.code == ProviderErrorCode::InvalidConfig {
                accounts::record_error(
                    ctx,
                    &planned.account_id,
                    error.code.as_str(),
                    &error.message,
                )
                .await?;
            }
            if error.is_terminal() && after.state == InstanceState::Error {
                Next::WhenWoken
            } else {
                let wait = timings
                    .provider_retry
                    .max(error.retry_after.unwrap_or_default());
                hold_retries(&inst, wait);
                Next::After(wait)
            }
        }
        _ => {
            forget_retries(&inst);
            if planned.account_has_error {
                accounts::clear_error(ctx, &planned.account_id).await?;
            }
            next_look(timings, &after)
        }
    };
    Ok(next)
}

/// What a pass does after planning.
enum Plan {
    /// No call and nothing to record: look again then.
    Wait(Next),
    /// No call, but something to record (a machine-less teardown, a broken account).
    Record(Vec<InstanceCommand>),
    /// A provider call.
    Call(Planned),
}

/// A planned call and what it needs.
struct Planned {
    provider: Arc<dyn Provider>,
    account_id: String,
    /// The account has a `lastError` to clear once a call succeeds.
    account_has_error: bool,
    call: Call,
}

/// The provider call a pass makes.
enum Call {
    /// Create the machine (idempotent by the instance id).
    Create(CreateMachine),
    /// Delete the machine.
    Delete(String),
    /// Read the machine, power it towards `desired` if it is elsewhere, and read it again.
    Look { id: String, desired: DesiredState },
}

/// What the provider answered.
enum Answer {
    /// The machine as it is now.
    Machine(Machine),
    /// A `get` or `power` found no machine: it was removed behind our back.
    Gone,
    /// The machine is deleted (or there was nothing to delete).
    Deleted,
    /// The call failed.
    Failed(ProviderError),
}

/// The result of an apply.
enum Applied {
    /// Recorded; the instance as it is now.
    Now(Box<Instance>),
    /// The instance changed since the plan: nothing recorded.
    Moved,
}

async fn plan(ctx: &Ctx, timings: &Timings, inst: &Instance) -> Result<Plan, CommandError> {
    let call = match (inst.state, inst.external_id.clone()) {
        (InstanceState::Deleted | InstanceState::Error, _) => {
            return Ok(Plan::Wait(Next::WhenWoken))
        }
        // `get` would find nothing again; only a delete moves a lost machine on.
        (InstanceState::Lost, _) => return Ok(Plan::Wait(Next::After(timings.lost_look))),
        (InstanceState::Deleting, None) => return Ok(Plan::Record(vec![InstanceCommand::Release])),
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
        (_, None) => return Ok(Plan::Wait(Next::After(timings.transitional_look))),
    };

    let mut tx = ctx.pool.begin().await?;
    let account_id: Option<String> =
        sqlx::query_scalar("SELECT provider_account_id FROM pools WHERE id = $1")
            .bind(&inst.pool_id)
            .fetch_optional(&mut *tx)
            .await?
            .flatten();
    let Some(account_id) = account_id else {
        return Ok(Plan::Record(vec![broken_account(format!(
            "pool {} has no provider account",
            inst.pool_id
        ))]));
    };
    let Some(account) = vps_projections::provider_accounts::load(&mut *tx, &account_id).await?
    else {
        return Ok(Plan::Record(vec![broken_account(format!(
            "provider account {account_id} does not exist"
        ))]));
    };
    let Some(config) = accounts::full_config(&mut tx, &ctx.secrets, &account).await? else {
        // Not the account's fault: the server runs with another sealing key. Restarting it with
        // the right `[secrets] key` heals this, so it is retried rather than failed.
        return Ok(Plan::Record(vec![InstanceCommand::SetCondition {
            condition_type: ConditionType::ProviderError,
            reason: ProviderErrorCode::InvalidConfig.as_str().into(),
            message: format!(
                "the credentials of provider account {account_id} do not open under this server's [secrets] key"
            ),
        }]));
    };
    let config = match ProviderConfig::parse(&account.provider, &config) {
        Ok(config) => config,
        Err(e) => {
            return Ok(Plan::Record(vec![broken_account(format!(
                "provider account {account_id}: {e}"
            ))]))
        }
    };
    let call = match call {
        Call::Create(mut request) => {
            let offer: Option<Option<String>> =
                sqlx::query("SELECT offer_id FROM flavors WHERE pool_id = $1 AND name = $2")
                    .bind(&inst.pool_id)
                    .bind(&inst.flavor)
                    .fetch_optional(&mut *tx)
                    .await?
                    .map(|r| r.get(0));
            let Some(offer_id) = offer.flatten() else {
                return Ok(Plan::Record(vec![broken_account(format!(
                    "flavor {} of pool {} has no offerId",
                    inst.flavor, inst.pool_id
                ))]));
            };
            request.offer_id = offer_id;
            if let Some(reference) = &inst.user_data_ref {
                request.user_data = vps_commands::secrets::open(&mut tx, &ctx.secrets, reference)
                    .await?
                    .and_then(|bytes| String::from_utf8(bytes).ok());
            }
            Call::Create(request)
        }
        other => other,
    };
    tx.commit().await?;
    Ok(Plan::Call(Planned {
        provider: build(config),
        account_id,
        account_has_error: account.last_error.is_some(),
        call,
    }))
}

/// A configuration fault no retry will fix: the instance fails with `INVALID_CONFIG`.
fn broken_account(message: String) -> InstanceCommand {
    InstanceCommand::Fail(Failure::Provider {
        code: ProviderErrorCode::InvalidConfig.as_str().into(),
        message,
    })
}

/// Makes the planned call. No transaction is open here.
async fn call(provider: &dyn Provider, call: &Call) -> Answer {
    match call {
        Call::Create(request) => match provider.create(request.clone()).await {
            Ok(machine) => Answer::Machine(machine),
            Err(e) => Answer::Failed(e),
        },
        Call::Delete(id) => match provider.delete(id).await {
            Ok(()) => Answer::Deleted,
            Err(e) if e.code == ProviderErrorCode::NotFound => Answer::Deleted,
            Err(e) => Answer::Failed(e),
        },
        Call::Look { id, desired } => {
            let machine = match provider.get(id).await {
                Ok(machine) => machine,
                Err(e) => return gone_or_failed(e),
            };
            let power = match (machine.state, desired) {
                (MachineState::Running, DesiredState::Stopped) => Power::GracefulOff,
                (MachineState::Stopped, DesiredState::Running) => Power::On,
                _ => return Answer::Machine(machine),
            };
            if let Err(e) = provider.power(id, power).await {
                return gone_or_failed(e);
            }
            match provider.get(id).await {
                Ok(machine) => Answer::Machine(machine),
                Err(e) => gone_or_failed(e),
            }
        }
    }
}

fn gone_or_failed(error: ProviderError) -> Answer {
    if error.code == ProviderErrorCode::NotFound {
        Answer::Gone
    } else {
        Answer::Failed(error)
    }
}

/// What the answer means for the instance, as commands (refusals of the state table are
/// skipped by `apply_all`).
fn commands_for(inst: &Instance, call: &Call, answer: &Answer) -> Vec<InstanceCommand> {
    match answer {
        Answer::Machine(machine) => {
            let mut commands = vec![match call {
                Call::Create(_) => InstanceCommand::Provisioned {
                    external_id: machine.id.clone(),
                    addresses: machine.addresses.clone(),
                },
                _ => InstanceCommand::RecordAddresses {
                    addresses: machine.addresses.clone(),
                    mode: AddressMode::Replace,
                },
            }];
            commands.push(InstanceCommand::ClearCondition(
                ConditionType::ProviderError,
            ));
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

/// Records `commands` on the instance, unless its stream moved since `planned` was read.
async fn apply(
    ctx: &Ctx,
    planned: &Instance,
    commands: &[InstanceCommand],
) -> Result<Applied, CommandError> {
    let now = Utc::now();
    let mut tx = ctx.pool.begin().await?;
    // The row lock keeps API commands from appending between the check and our append.
    sqlx::query("SELECT 1 FROM instances WHERE id = $1 FOR UPDATE")
        .bind(&planned.id)
        .execute(&mut *tx)
        .await?;
    let Some(current) = load(&mut tx, &planned.id).await? else {
        return Ok(Applied::Moved);
    };
    if current.version != planned.version {
        return Ok(Applied::Moved);
    }
    match apply_all(ctx, &mut tx, &current, commands, now).await {
        Ok(_) => {}
        Err(e) if e.is_retryable() => return Ok(Applied::Moved),
        Err(e) => return Err(e),
    }
    let after = load(&mut tx, &planned.id)
        .await?
        .expect("the instance exists");
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(Applied::Now(Box::new(after)))
}

/// A create answered while the instance moved on. If it is being deleted and never learnt of
/// this machine, nothing else would ever delete the machine: delete it now.
async fn drop_if_unwanted(
    ctx: &Ctx,
    provider: &dyn Provider,
    instance_id: &str,
    machine: &Machine,
) -> Result<(), CommandError> {
    let mut conn = ctx.pool.acquire().await?;
    let Some(current) = load(&mut conn, instance_id).await? else {
        return Ok(());
    };
    drop(conn);
    let unwanted = current.external_id.is_none()
        && (current.desired_state == DesiredState::Deleted
            || matches!(
                current.state,
                InstanceState::Deleting | InstanceState::Deleted
            ));
    if unwanted {
        match provider.delete(&machine.id).await {
            Ok(()) => {}
            Err(e) if e.code == ProviderErrorCode::NotFound => {}
            Err(e) => tracing::warn!(
                instance = instance_id, machine = %machine.id, error = %e,
                "cannot delete the machine of an instance deleted while it was created"
            ),
        }
    }
    Ok(())
}

/// When to look at an instance again, from where it stands.
fn next_look(timings: &Timings, inst: &Instance) -> Next {
    match inst.state {
        InstanceState::Deleted | InstanceState::Error => Next::WhenWoken,
        InstanceState::Lost => Next::After(timings.lost_look),
        state if state == inst.desired_state.as_state() => Next::After(timings.provider_poll),
        _ => Next::After(timings.transitional_look),
    }
}

/// Instances whose last call failed, and the earliest time to call again. Keyed by instance id
/// and creation time, so two databases in one process (tests) never share an entry. Lost on a
/// restart, which costs one early retry.
fn retries() -> &'static Mutex<HashMap<String, Instant>> {
    static RETRIES: OnceLock<Mutex<HashMap<String, Instant>>> = OnceLock::new();
    RETRIES.get_or_init(Mutex::default)
}

fn retry_key(inst: &Instance) -> String {
    format!("{}@{}", inst.id, inst.created_at.timestamp_micros())
}

fn hold_retries(inst: &Instance, wait: Duration) {
    let mut retries = retries().lock().unwrap_or_else(|e| e.into_inner());
    retries.insert(retry_key(inst), Instant::now() + wait);
}

fn forget_retries(inst: &Instance) {
    let mut retries = retries().lock().unwrap_or_else(|e| e.into_inner());
    retries.remove(&retry_key(inst));
}

/// How long to hold off calling, when a failed call asked for a wait that has not passed.
///
/// Recording a `ProviderError` condition is an instance event, and every instance event wakes
/// the instance, so without this the retry would come at once. The wait remembered in this
/// process honours `Retry-After`; the condition's own time covers a restarted server or another
/// replica.
fn retry_wait(timings: &Timings, inst: &Instance) -> Option<Duration> {
    if matches!(
        inst.state,
        InstanceState::Error | InstanceState::Deleted | InstanceState::Lost
    ) {
        return None;
    }
    let remembered = {
        let retries = retries().lock().unwrap_or_else(|e| e.into_inner());
        retries
            .get(&retry_key(inst))
            .and_then(|at| at.checked_duration_since(Instant::now()))
    };
    let recorded = inst
        .condition(ConditionType::ProviderError)
        .and_then(|_| {
            let until =
                inst.updated_at + chrono::TimeDelta::from_std(timings.provider_retry).ok()?;
            (until - Utc::now()).to_std().ok()
        })
        .filter(|wait| !wait.is_zero());
    match (remembered, recorded) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_removed_behind_our_back_is_gone_and_a_throttled_call_is_a_failure() {
        assert!(matches!(
            gone_or_failed(ProviderError::not_found("no server")),
            Answer::Gone
        ));
        assert!(matches!(
            gone_or_failed(ProviderError::rate_limited("slow down", None)),
            Answer::Failed(_)
        ));
    }
}
