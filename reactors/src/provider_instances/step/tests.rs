//! One row per situation of the provider reconciler, for each of its pure steps.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::json;
use vps_domain::condition::ConditionType;
use vps_domain::instance::{AddressMode, Failure, Instance, InstanceCommand, Observed, PoolKind};
use vps_domain::state_table::{DesiredState, InstanceState};

use super::*;
use crate::fixtures::{now, with_condition};
use crate::providers::EmulatorConfig;

fn instance(state: InstanceState, desired: DesiredState, machine: Option<&str>) -> Instance {
    let mut inst = crate::fixtures::instance(PoolKind::Provider, state, desired);
    inst.external_id = machine.map(str::to_string);
    inst
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn at(from_now: i64) -> Option<DateTime<Utc>> {
    Some(now() + TimeDelta::seconds(from_now))
}

fn create(offer: &str, user_data: Option<&str>) -> Call {
    Call::Create(CreateMachine {
        idempotency_key: "inst_1".into(),
        name: "inst_1".into(),
        offer_id: offer.into(),
        image_id: "debian-12".into(),
        user_data: user_data.map(str::to_string),
    })
}

fn look(desired: DesiredState) -> Call {
    Call::Look {
        id: "m-1".into(),
        desired,
    }
}

fn invalid_config(message: &str) -> Vec<InstanceCommand> {
    vec![InstanceCommand::Fail(Failure::Provider {
        code: "INVALID_CONFIG".into(),
        message: message.into(),
    })]
}

#[test]
fn plan_calls_or_waits_by_where_the_instance_stands() {
    let t = Timings::default();
    let running = || instance(InstanceState::Running, DesiredState::Running, Some("m-1"));
    let rows: Vec<(&str, Instance, Option<DateTime<Utc>>, Plan)> = vec![
        (
            "scheduling without a machine: create",
            instance(InstanceState::Scheduling, DesiredState::Running, None),
            None,
            Plan::Call(create("", None)),
        ),
        (
            "running with a machine: poll it",
            running(),
            None,
            Plan::Call(look(DesiredState::Running)),
        ),
        (
            "running, wanted stopped: poll it towards stopped",
            instance(InstanceState::Running, DesiredState::Stopped, Some("m-1")),
            None,
            Plan::Call(look(DesiredState::Stopped)),
        ),
        (
            "deleting with a machine: delete it",
            instance(InstanceState::Deleting, DesiredState::Deleted, Some("m-1")),
            None,
            Plan::Call(Call::Delete("m-1".into())),
        ),
        (
            "deleting without a machine: release at once",
            instance(InstanceState::Deleting, DesiredState::Deleted, None),
            None,
            Plan::Record(vec![InstanceCommand::Release]),
        ),
        (
            "starting without a machine: look again soon",
            instance(InstanceState::Starting, DesiredState::Running, None),
            None,
            Plan::Wait(Next::After(t.transitional_look())),
        ),
        (
            "lost: only a delete moves it on",
            instance(InstanceState::Lost, DesiredState::Running, Some("m-1")),
            at(100),
            Plan::Wait(Next::After(t.lost_look())),
        ),
        (
            "deleted: only when woken",
            instance(InstanceState::Deleted, DesiredState::Deleted, None),
            at(100),
            Plan::Wait(Next::WhenWoken),
        ),
        (
            "error: only when woken",
            instance(InstanceState::Error, DesiredState::Running, Some("m-1")),
            None,
            Plan::Wait(Next::WhenWoken),
        ),
    ];
    for (name, inst, retry_at, expected) in rows {
        assert_eq!(plan(&inst, retry_at, now(), &t), expected, "{name}");
    }
}

#[test]
fn plan_holds_off_while_a_failed_call_asks_to_wait() {
    let t = Timings::default();
    let running = || instance(InstanceState::Running, DesiredState::Running, Some("m-1"));
    // The condition recorded 10 s ago (`updated_at`): `provider_retry` has not passed.
    let mut throttled = with_condition(
        running(),
        ConditionType::ProviderError,
        "RATE_LIMITED",
        now(),
    );
    throttled.updated_at = now() - TimeDelta::seconds(10);
    let rows: Vec<(&str, Instance, Option<DateTime<Utc>>, Plan)> = vec![
        (
            "the item's retry time is ahead: wait for it",
            running(),
            at(45),
            Plan::Wait(Next::After(secs(45))),
        ),
        (
            "the item's retry time has passed: call",
            running(),
            at(-5),
            Plan::Call(look(DesiredState::Running)),
        ),
        (
            "a recent ProviderError condition: wait out provider_retry",
            throttled.clone(),
            None,
            Plan::Wait(Next::After(t.provider_retry() - secs(10))),
        ),
        (
            "both: the later wins",
            throttled,
            at(90),
            Plan::Wait(Next::After(secs(90))),
        ),
    ];
    for (name, inst, retry_at, expected) in rows {
        assert_eq!(plan(&inst, retry_at, now(), &t), expected, "{name}");
    }
}

#[test]
fn prepare_readies_the_call_or_records_the_configuration_fault() {
    let scheduling = instance(InstanceState::Scheduling, DesiredState::Running, None);
    let found = |config: Option<serde_json::Value>| Account::Found {
        id: "pacct_1".into(),
        provider: "emulator".into(),
        has_error: true,
        config,
    };
    let facts = |account, offer: Option<&str>| CallFacts {
        account,
        offer_id: offer.map(str::to_string),
        user_data: Some("#cloud-config".into()),
    };
    let ready = |call| {
        Prepared::Call(Box::new(Planned {
            config: ProviderConfig::Emulator(EmulatorConfig::default()),
            account_id: "pacct_1".into(),
            account_has_error: true,
            call,
        }))
    };
    let unparsable = json!({"bootDelayMs": "soon"});
    let parse_error = ProviderConfig::parse("emulator", &unparsable).unwrap_err();
    let rows: Vec<(&str, Call, CallFacts, Prepared)> = vec![
        ("a create gets its offer and user data",
         create("", None), facts(found(Some(json!({}))), Some("cx22")),
         ready(create("cx22", Some("#cloud-config")))),
        ("a poll needs no offer",
         look(DesiredState::Running), facts(found(Some(json!({}))), None),
         ready(look(DesiredState::Running))),
        ("the pool has no account",
         create("", None), facts(Account::Unset, Some("cx22")),
         Prepared::Record(invalid_config("pool pool_1 has no provider account"))),
        ("the account is gone",
         Call::Delete("m-1".into()), facts(Account::Missing("pacct_9".into()), None),
         Prepared::Record(invalid_config("provider account pacct_9 does not exist"))),
        ("the credentials do not open: a condition, retried",
         look(DesiredState::Running), facts(found(None), None),
         Prepared::Record(vec![InstanceCommand::SetCondition {
             condition_type: ConditionType::ProviderError,
             reason: "INVALID_CONFIG".into(),
             message: "the credentials of provider account pacct_1 do not open under this server's [secrets] key".into(),
         }])),
        ("the configuration does not parse",
         look(DesiredState::Running), facts(found(Some(unparsable.clone())), None),
         Prepared::Record(invalid_config(&format!("provider account pacct_1: {parse_error}")))),
        ("the flavor has no offerId",
         create("", None), facts(found(Some(json!({}))), None),
         Prepared::Record(invalid_config("flavor small of pool pool_1 has no offerId"))),
    ];
    for (name, call, facts, expected) in rows {
        assert_eq!(prepare(&scheduling, call, facts), expected, "{name}");
    }
}

#[test]
fn commands_for_says_what_a_machine_answer_means() {
    let inst = instance(InstanceState::Running, DesiredState::Running, Some("m-1"));
    let machine = |state| {
        Answer::Machine(Machine {
            id: "m-1".into(),
            state,
            addresses: vec!["192.0.2.7".into()],
        })
    };
    let clear = InstanceCommand::ClearCondition(ConditionType::ProviderError);
    let replace = InstanceCommand::RecordAddresses {
        addresses: vec!["192.0.2.7".into()],
        mode: AddressMode::Replace,
    };
    let rows: Vec<(&str, Call, Answer, Vec<InstanceCommand>)> = vec![
        (
            "created and running",
            create("cx22", None),
            machine(MachineState::Running),
            vec![
                InstanceCommand::Provisioned {
                    external_id: "m-1".into(),
                    addresses: vec!["192.0.2.7".into()],
                },
                clear.clone(),
                InstanceCommand::Observe(Observed::Running),
            ],
        ),
        (
            "polled, still booting",
            look(DesiredState::Running),
            machine(MachineState::Starting),
            vec![replace.clone(), clear.clone()],
        ),
        (
            "polled, stopped",
            look(DesiredState::Stopped),
            machine(MachineState::Stopped),
            vec![
                replace.clone(),
                clear.clone(),
                InstanceCommand::Observe(Observed::Stopped),
            ],
        ),
        (
            "polled, in error",
            look(DesiredState::Running),
            machine(MachineState::Error),
            vec![
                replace,
                clear,
                InstanceCommand::Fail(Failure::Runtime {
                    message: "the provider reports machine m-1 of instance inst_1 in error".into(),
                }),
            ],
        ),
    ];
    for (name, call, answer, expected) in rows {
        assert_eq!(commands_for(&inst, &call, &answer), expected, "{name}");
    }
}

#[test]
fn commands_for_says_what_a_removal_or_a_failure_means() {
    let inst = instance(InstanceState::Running, DesiredState::Running, Some("m-1"));
    let rows: Vec<(&str, Call, Answer, Vec<InstanceCommand>)> = vec![
        (
            "gone behind our back",
            look(DesiredState::Running),
            Answer::Gone,
            vec![InstanceCommand::Lose],
        ),
        (
            "deleted",
            Call::Delete("m-1".into()),
            Answer::Deleted,
            vec![InstanceCommand::Release],
        ),
        (
            "throttled: a condition, retried",
            look(DesiredState::Running),
            Answer::Failed(ProviderError::rate_limited("slow down", Some(secs(90)))),
            vec![InstanceCommand::SetCondition {
                condition_type: ConditionType::ProviderError,
                reason: "RATE_LIMITED".into(),
                message: "slow down".into(),
            }],
        ),
        (
            "refused for good: failed",
            create("cx22", None),
            Answer::Failed(ProviderError::invalid_state("no such image")),
            vec![InstanceCommand::Fail(Failure::Provider {
                code: "INVALID_STATE".into(),
                message: "no such image".into(),
            })],
        ),
    ];
    for (name, call, answer, expected) in rows {
        assert_eq!(commands_for(&inst, &call, &answer), expected, "{name}");
    }
}

fn planned(has_error: bool) -> Planned {
    Planned {
        config: ProviderConfig::Emulator(EmulatorConfig::default()),
        account_id: "pacct_1".into(),
        account_has_error: has_error,
        call: look(DesiredState::Running),
    }
}

fn outcome(next: Next, retry_at: Option<DateTime<Utc>>, account: AccountChange) -> Outcome {
    Outcome {
        next,
        retry_at,
        account,
    }
}

#[test]
fn answered_after_a_call_says_when_to_look_again() {
    let t = Timings::default();
    let machine = Answer::Machine(Machine {
        id: "m-1".into(),
        state: MachineState::Running,
        addresses: Vec::new(),
    });
    let running = instance(InstanceState::Running, DesiredState::Running, Some("m-1"));
    let starting = instance(InstanceState::Starting, DesiredState::Running, Some("m-1"));
    let lost = instance(InstanceState::Lost, DesiredState::Running, Some("m-1"));
    let deleted = instance(InstanceState::Deleted, DesiredState::Deleted, None);
    let rows: Vec<(&str, bool, Answer, Option<&Instance>, Outcome)> = vec![
        (
            "settled: poll later, forget the retry time",
            false,
            machine.clone(),
            Some(&running),
            outcome(Next::After(t.provider_poll()), None, AccountChange::Keep),
        ),
        (
            "booting: look again soon, clear the account's error",
            true,
            machine.clone(),
            Some(&starting),
            outcome(
                Next::After(t.transitional_look()),
                None,
                AccountChange::Clear,
            ),
        ),
        (
            "gone: lost",
            false,
            Answer::Gone,
            Some(&lost),
            outcome(Next::After(t.lost_look()), None, AccountChange::Keep),
        ),
        (
            "deleted: only when woken",
            false,
            Answer::Deleted,
            Some(&deleted),
            outcome(Next::WhenWoken, None, AccountChange::Keep),
        ),
        (
            "the instance moved on: plan again at once, keep the retry time",
            true,
            machine,
            None,
            outcome(Next::After(Duration::ZERO), at(-1), AccountChange::Keep),
        ),
    ];
    for (name, has_error, answer, after, expected) in rows {
        let got = answered(&planned(has_error), &answer, after, at(-1), now(), &t);
        assert_eq!(got, expected, "{name}");
    }
}

#[test]
fn answered_after_a_failed_call_keeps_its_retry_time_and_notes_the_account() {
    let t = Timings::default();
    let running = instance(InstanceState::Running, DesiredState::Running, Some("m-1"));
    let failed = instance(InstanceState::Error, DesiredState::Running, Some("m-1"));
    let throttled = ProviderError::rate_limited("slow down", Some(secs(90)));
    let invalid = ProviderError::invalid_config("bad token");
    let retry = at(t.provider_retry().as_secs() as i64);
    let rows: Vec<(&str, bool, Answer, Option<&Instance>, Outcome)> = vec![
        (
            "throttled for longer than provider_retry: wait as asked",
            false,
            Answer::Failed(throttled),
            Some(&running),
            outcome(Next::After(secs(90)), at(90), AccountChange::Keep),
        ),
        (
            "a transient failure: wait provider_retry",
            false,
            Answer::Failed(ProviderError::provider("503")),
            Some(&running),
            outcome(Next::After(t.provider_retry()), retry, AccountChange::Keep),
        ),
        (
            "the account's configuration refused: failed, recorded on the account",
            false,
            Answer::Failed(invalid.clone()),
            Some(&failed),
            outcome(
                Next::WhenWoken,
                at(-1),
                AccountChange::Record(invalid.clone()),
            ),
        ),
        (
            "terminal but the instance is not in error: retried",
            false,
            Answer::Failed(invalid.clone()),
            Some(&running),
            outcome(
                Next::After(t.provider_retry()),
                retry,
                AccountChange::Record(invalid),
            ),
        ),
    ];
    for (name, has_error, answer, after, expected) in rows {
        let got = answered(&planned(has_error), &answer, after, at(-1), now(), &t);
        assert_eq!(got, expected, "{name}");
    }
}

#[test]
fn a_pass_without_a_call_looks_again_by_what_it_recorded() {
    let t = Timings::default();
    let deleted = instance(InstanceState::Deleted, DesiredState::Deleted, None);
    let waiting = instance(InstanceState::Running, DesiredState::Running, Some("m-1"));
    let condition = vec![InstanceCommand::SetCondition {
        condition_type: ConditionType::ProviderError,
        reason: "INVALID_CONFIG".into(),
        message: String::new(),
    }];
    let release = vec![InstanceCommand::Release];
    let rows: Vec<(&str, &[InstanceCommand], Option<&Instance>, Next)> = vec![
        (
            "released: only when woken",
            &release,
            Some(&deleted),
            Next::WhenWoken,
        ),
        (
            "a condition: retry after provider_retry",
            &condition,
            Some(&waiting),
            Next::After(t.provider_retry()),
        ),
        (
            "the instance moved on: at once",
            &release,
            None,
            Next::After(Duration::ZERO),
        ),
    ];
    for (name, commands, after, expected) in rows {
        assert_eq!(recorded(commands, after, &t), expected, "{name}");
    }
}

#[test]
fn a_machine_is_unwanted_only_by_an_instance_being_deleted_that_never_learnt_of_it() {
    let rows = [
        (
            "deleting, no machine known",
            instance(InstanceState::Deleting, DesiredState::Deleted, None),
            true,
        ),
        (
            "scheduling, deletion asked",
            instance(InstanceState::Scheduling, DesiredState::Deleted, None),
            true,
        ),
        (
            "deleted",
            instance(InstanceState::Deleted, DesiredState::Deleted, None),
            true,
        ),
        (
            "still wanted",
            instance(InstanceState::Scheduling, DesiredState::Running, None),
            false,
        ),
        (
            "knows its machine",
            instance(InstanceState::Deleting, DesiredState::Deleted, Some("m-1")),
            false,
        ),
    ];
    for (name, inst, expected) in rows {
        assert_eq!(unwanted(&inst), expected, "{name}");
    }
}
