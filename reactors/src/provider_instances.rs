//! The instance reconciler's provider path (SPEC §3.6): each pass **plans** in a short
//! transaction (the instance, its pool's account, the call to make), **calls** the provider
//! with no transaction open (the instance id is the idempotency key), then **applies** the
//! answer in a new transaction, only if the instance's stream version has not moved meanwhile;
//! otherwise it plans again at once. Every decision is a pure function in `step`; this module
//! reads, calls and records.
//!
//! | instance | call |
//! | --- | --- |
//! | `scheduling`, no machine | `create` (flavor's `offerId`, image, sealed user data) |
//! | `deleting` with a machine | `delete` (`NOT_FOUND` counts as done) |
//! | any other live state with a machine | `get`, then `power` if the machine is not where `desiredState` wants it, then `get` |
//! | `deleted`, `error`, `lost` | none |
//!
//! After a failed call the earliest time to call again is kept on the work item (`retry_at`),
//! so it holds across restarts and replicas. A provider is built per pass from the account
//! (cheap, no I/O; every `emulator` account shares one in-process cloud).

mod step;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use vps_commands::pipeline::{apply_commands, commit};
use vps_commands::provider_accounts as accounts;
use vps_commands::{CommandError, Ctx};
use vps_domain::instance::{Instance, InstanceCommand};
use vps_domain::state_table::DesiredState;
use vps_projections::instances::load;

use self::step::{
    answered, commands_for, plan, prepare, recorded, unwanted, Account, AccountChange, Answer,
    Call, CallFacts, Plan, Prepared,
};
use crate::providers::{
    build, Machine, MachineState, Power, Provider, ProviderError, ProviderErrorCode,
};
use crate::timings::Timings;
use crate::work_queue::{Next, Pass};

/// One pass over a provider instance; `retry_at` is its work item's.
pub async fn reconcile(
    ctx: &Ctx,
    timings: &Timings,
    inst: Instance,
    retry_at: Option<DateTime<Utc>>,
) -> Result<Pass, CommandError> {
    let keep = |next| Pass { next, retry_at };
    let call = match plan(&inst, retry_at, ctx.clock.now(), timings) {
        Plan::Wait(next) => return Ok(keep(next)),
        Plan::Record(commands) => return Ok(keep(record(ctx, timings, &inst, &commands).await?)),
        Plan::Call(call) => call,
    };
    let planned = match read_call_facts(ctx, &inst, call).await? {
        Prepared::Record(commands) => {
            return Ok(keep(record(ctx, timings, &inst, &commands).await?))
        }
        Prepared::Call(planned) => planned,
    };
    let provider = build(planned.config.clone());
    let answer = call_provider(&*provider, &planned.call).await;
    let commands = commands_for(&inst, &planned.call, &answer);
    let after = apply(ctx, &inst, &commands).await?;
    if let (None, Call::Create(_), Answer::Machine(machine)) = (&after, &planned.call, &answer) {
        drop_if_unwanted(ctx, &*provider, &inst.id, machine).await?;
    }
    let outcome = answered(
        &planned,
        &answer,
        after.as_deref(),
        retry_at,
        ctx.clock.now(),
        timings,
    );
    match outcome.account {
        AccountChange::Keep => {}
        AccountChange::Record(error) => {
            accounts::record_error(
                ctx,
                &planned.account_id,
                error.code.as_str(),
                &error.message,
            )
            .await?
        }
        AccountChange::Clear => accounts::clear_error(ctx, &planned.account_id).await?,
    }
    Ok(Pass {
        next: outcome.next,
        retry_at: outcome.retry_at,
    })
}

/// Records the commands of a pass without a call, and says when to look again.
async fn record(
    ctx: &Ctx,
    timings: &Timings,
    inst: &Instance,
    commands: &[InstanceCommand],
) -> Result<Next, CommandError> {
    let after = apply(ctx, inst, commands).await?;
    Ok(recorded(commands, after.as_deref(), timings))
}

/// Reads, in one short transaction, what the call needs (`CallFacts`), and readies it.
async fn read_call_facts(ctx: &Ctx, inst: &Instance, call: Call) -> Result<Prepared, CommandError> {
    let mut tx = ctx.pool.begin().await?;
    let account = read_account(&mut tx, ctx, inst).await?;
    let (mut offer_id, mut user_data) = (None, None);
    if matches!(call, Call::Create(_)) {
        offer_id = vps_projections::flavors::offer_id(&mut tx, &inst.pool_id, &inst.flavor).await?;
        if let Some(reference) = &inst.user_data_ref {
            user_data = vps_commands::secrets::open(&mut tx, &ctx.secrets, reference)
                .await?
                .and_then(|bytes| String::from_utf8(bytes).ok());
        }
    }
    tx.commit().await?;
    let facts = CallFacts {
        account,
        offer_id,
        user_data,
    };
    Ok(prepare(inst, call, facts))
}

/// The pool's provider account, its credentials opened.
async fn read_account(
    tx: &mut PgConnection,
    ctx: &Ctx,
    inst: &Instance,
) -> Result<Account, CommandError> {
    let account_id = vps_projections::pools::provider_account_id(tx, &inst.pool_id).await?;
    let Some(account_id) = account_id else {
        return Ok(Account::Unset);
    };
    let Some(account) = vps_projections::provider_accounts::load(&mut *tx, &account_id).await?
    else {
        return Ok(Account::Missing(account_id));
    };
    let config = accounts::full_config(tx, &ctx.secrets, &account).await?;
    Ok(Account::Found {
        id: account_id,
        provider: account.provider,
        has_error: account.last_error.is_some(),
        config,
    })
}

/// Makes the planned call. No transaction is open here.
async fn call_provider(provider: &dyn Provider, call: &Call) -> Answer {
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

/// Records `commands` on the instance, unless its stream moved since `planned` was read.
/// Returns the instance as they left it, or `None` when it had moved (nothing recorded).
async fn apply(
    ctx: &Ctx,
    planned: &Instance,
    commands: &[InstanceCommand],
) -> Result<Option<Box<Instance>>, CommandError> {
    let now = ctx.clock.now();
    let mut tx = ctx.pool.begin().await?;
    // The row lock keeps API commands from appending between the check and our append.
    vps_projections::instances::reads::lock_row(&mut tx, &planned.id).await?;
    let Some(current) = load(&mut tx, &planned.id).await? else {
        return Ok(None);
    };
    if current.version != planned.version {
        return Ok(None);
    }
    let after = match apply_commands(ctx, &mut tx, &current, commands, now).await {
        Ok(after) => after.unwrap_or(current),
        Err(e) if e.is_retryable() => return Ok(None),
        Err(e) => return Err(e),
    };
    commit(ctx, tx).await?;
    Ok(Some(Box::new(after)))
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
    if unwanted(&current) {
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
