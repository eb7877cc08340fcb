//! Given/when/then tests of the instance aggregate.

use std::sync::Mutex;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::authz::InstanceDraft;
use crate::condition::ConditionType;
use crate::error::{DomainError, ErrorCode};
use crate::ids;
use crate::placement::Unschedulable;
use crate::resources::{Gpus, QuotaResource, Shape};
use crate::state_table::{self, DesiredState, InstanceState};

// ---- harness -------------------------------------------------------------------------------

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap()
}

/// A history of events, each recorded one second after the previous.
struct Given {
    history: Vec<InstanceEvent>,
    now: DateTime<Utc>,
}

/// What a command did to a history.
struct When {
    before: Option<Instance>,
    result: Result<Vec<InstanceEvent>, DomainError>,
    now: DateTime<Utc>,
}

fn given(history: Vec<InstanceEvent>) -> Given {
    let now = t0() + TimeDelta::seconds(history.len() as i64);
    Given { history, now }
}

/// The events that running `commands` in order on a new instance appends.
fn after(commands: &[InstanceCommand]) -> Vec<InstanceEvent> {
    let mut history: Vec<InstanceEvent> = Vec::new();
    for cmd in commands {
        let outcome = given(history.clone()).when(cmd.clone());
        let events = outcome
            .result
            .unwrap_or_else(|e| panic!("setting up with {cmd:?} failed: {e}"));
        history.extend(events);
    }
    history
}

fn state_of(history: &[InstanceEvent]) -> Option<Instance> {
    let times = (0..).map(|i| t0() + TimeDelta::seconds(i));
    fold(history.iter().zip(times)).expect("history folds")
}

impl Given {
    fn at(mut self, now: DateTime<Utc>) -> Given {
        self.now = now;
        self
    }

    fn when(self, cmd: InstanceCommand) -> When {
        let before = state_of(&self.history);
        let result = decide(before.as_ref(), &cmd, self.now);
        When {
            before,
            result,
            now: self.now,
        }
    }
}

impl When {
    /// Asserts exactly these events, and returns the instance they leave.
    fn then(self, expected: Vec<InstanceEvent>) -> Instance {
        let events = self.result.clone().expect("the command is accepted");
        assert_eq!(events, expected);
        self.after()
    }

    /// Asserts events of exactly these types, and returns the instance they leave.
    fn then_types(self, expected: &[&str]) -> Instance {
        let events = self.result.clone().expect("the command is accepted");
        let types: Vec<_> = events.iter().map(InstanceEvent::event_type).collect();
        assert_eq!(types, expected);
        self.after()
    }

    /// Asserts a refusal with `code` (and so no events), and returns it.
    fn then_refused(self, code: crate::error::ErrorCode) -> DomainError {
        let error = self.result.expect_err("the command is refused");
        assert_eq!(error.code(), code, "{error}");
        error
    }

    fn after(self) -> Instance {
        let events = self.result.expect("accepted");
        let mut state = self.before;
        for event in &events {
            let from = state.as_ref().map(|i| i.state);
            let next = evolve(state, event, self.now).expect("events apply");
            // Every move any decision makes is a row of the table.
            if let Some(from) = from {
                assert!(
                    from == next.state || state_table::allows(from, next.state),
                    "{from} → {} is not in the table",
                    next.state
                );
            }
            state = Some(next);
        }
        state.expect("an instance")
    }
}

// ---- fixtures ------------------------------------------------------------------------------

fn small() -> Shape {
    Shape {
        vcpu: 2,
        memory_gib: 4,
        disk_gib: 20,
        gpus: None,
    }
}

const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop";

fn create_in(kind: PoolKind) -> CreateInstance {
    CreateInstance {
        id: ids::instance_id(ids::Origin {
            tenant: "acme",
            caller: "id_alice",
            key: "build-agent-7",
        }),
        tenant_id: "acme".into(),
        pool_id: "pool_01jz0000000000000000000000".into(),
        pool_kind: kind,
        flavor: "g1.small".into(),
        shape: small(),
        image_id: "ubuntu-24.04".into(),
        ssh_keys: vec![KEY.into()],
        user_data_ref: Some("secret://acme/user-data/1".into()),
        project_id: None,
        desired_state: DesiredState::Running,
        owner_identity_id: "id_alice".into(),
        idempotency_key: "build-agent-7".into(),
        request_hash: "hash-1".into(),
        sandbox_id: None,
        warm_template_id: None,
        template_version: None,
        network_policy: None,
        network_rules: Default::default(),
        restore_from: None,
        volumes: Vec::new(),
        labels: Default::default(),
    }
}

fn create() -> InstanceCommand {
    InstanceCommand::Create(Box::new(create_in(PoolKind::Hosted)))
}

fn place_on(node: &str) -> InstanceCommand {
    InstanceCommand::Place(PlaceInstance {
        node_id: node.into(),
        allocation_id: format!("alloc_of_{node}"),
        address: "10.0.0.2".into(),
    })
}

fn place() -> InstanceCommand {
    place_on("node_a")
}

fn api_start() -> InstanceCommand {
    InstanceCommand::Start {
        requester: Requester::Api,
    }
}

fn api_stop() -> InstanceCommand {
    InstanceCommand::Stop {
        requester: Requester::Api,
    }
}

fn api_delete() -> InstanceCommand {
    InstanceCommand::Delete {
        requester: Requester::Api,
        reason: None,
    }
}

fn observe(o: Observed) -> InstanceCommand {
    InstanceCommand::Observe(o)
}

fn running() -> Vec<InstanceEvent> {
    after(&[create(), place(), observe(Observed::Running)])
}

fn stopped() -> Vec<InstanceEvent> {
    after(&[
        create(),
        place(),
        observe(Observed::Running),
        api_stop(),
        observe(Observed::Stopped),
    ])
}

fn refused_by(node: &str) -> InstanceCommand {
    InstanceCommand::ReportResourcesExhausted {
        node_id: node.into(),
        message: "ResourcesExhausted: 4 GiB of memory not available".into(),
    }
}

fn recreate_exhausted(now: DateTime<Utc>) -> InstanceCommand {
    InstanceCommand::Recreate(RecreateCause::ResourcesExhausted {
        exclude_until: now + TimeDelta::minutes(10),
    })
}

fn resize_to(flavor: &str, shape: Shape) -> InstanceCommand {
    InstanceCommand::Resize(ResizeInstance {
        flavor: flavor.into(),
        shape,
    })
}

// ---- admission -----------------------------------------------------------------------------

#[test]
fn a_create_is_admitted_in_scheduling_wanting_what_was_asked() {
    let inst = given(vec![])
        .when(create())
        .then_types(&["instance.created"]);
    assert_eq!(inst.state, InstanceState::Scheduling);
    assert_eq!(inst.desired_state, DesiredState::Running);
    assert_eq!(inst.version, 1);
    assert_eq!(inst.created_at, t0());
    assert_eq!(inst.ssh_keys, vec![KEY.to_string()]);
}

#[test]
fn a_second_create_with_the_same_request_is_a_replay_with_no_new_events() {
    given(after(&[create()])).when(create()).then(vec![]);
}

#[test]
fn a_second_create_with_another_request_is_a_conflict_naming_the_instance() {
    let mut other = create_in(PoolKind::Hosted);
    other.request_hash = "hash-2".into();
    let error = given(after(&[create()]))
        .when(InstanceCommand::Create(Box::new(other)))
        .then_refused(ErrorCode::Conflict);
    assert_eq!(
        error.details(),
        json!({ "instanceId": ids::instance_id(ids::Origin { tenant: "acme", caller: "id_alice", key: "build-agent-7" }) })
    );
}

#[test]
fn a_create_carrying_a_private_key_is_refused_as_a_private_key() {
    let mut c = create_in(PoolKind::Hosted);
    c.ssh_keys =
        vec!["-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----".into()];
    let error = given(vec![])
        .when(InstanceCommand::Create(Box::new(c)))
        .then_refused(ErrorCode::InvalidInput);
    assert!(error.to_string().contains("private key"));
}

#[test]
fn an_instance_cannot_belong_to_a_sandbox_and_a_template_at_once() {
    let mut c = create_in(PoolKind::Hosted);
    c.sandbox_id = Some("sbx_x".into());
    c.warm_template_id = Some("sbxt_x".into());
    given(vec![])
        .when(InstanceCommand::Create(Box::new(c)))
        .then_refused(ErrorCode::InvalidInput);
}

#[test]
fn any_command_but_create_on_a_missing_instance_is_not_found() {
    given(vec![])
        .when(api_start())
        .then_refused(ErrorCode::NotFound);
}

// ---- placement -----------------------------------------------------------------------------

#[test]
fn placing_moves_scheduling_to_provisioning_on_the_node_with_its_address() {
    let inst = given(after(&[create()]))
        .when(place())
        .then_types(&["instance.scheduled"]);
    assert_eq!(inst.state, InstanceState::Provisioning);
    assert_eq!(inst.node_id.as_deref(), Some("node_a"));
    assert_eq!(inst.allocation_id.as_deref(), Some("alloc_of_node_a"));
    assert_eq!(inst.addresses, vec!["10.0.0.2".to_string()]);
}

#[test]
fn no_fit_is_recorded_once_and_cleared_by_placement() {
    let history = after(&[create()]);
    let inst = given(history.clone())
        .when(InstanceCommand::MarkUnschedulable(Unschedulable::NoFit))
        .then_types(&["instance.condition.set"]);
    let condition = inst.condition(ConditionType::Unschedulable).unwrap();
    assert_eq!(condition.reason, "NoFit");

    let history = after(&[
        create(),
        InstanceCommand::MarkUnschedulable(Unschedulable::NoFit),
    ]);
    given(history.clone())
        .when(InstanceCommand::MarkUnschedulable(Unschedulable::NoFit))
        .then(vec![]);
    let inst = given(history)
        .when(place())
        .then_types(&["instance.condition.cleared", "instance.scheduled"]);
    assert!(inst.conditions.is_empty());
}

#[test]
fn a_placed_instance_cannot_be_placed_again() {
    given(after(&[create(), place()]))
        .when(place_on("node_b"))
        .then_refused(ErrorCode::InvalidState);
}

// ---- start, stop, delete -------------------------------------------------------------------

#[test]
fn stop_changes_only_the_desired_state_and_announces_stopping() {
    let before = state_of(&running()).unwrap();
    let inst = given(running())
        .when(api_stop())
        .then(vec![InstanceEvent::Stopping(Common {
            instance_id: before.id.clone(),
            tenant_id: "acme".into(),
            pool_id: before.pool_id.clone(),
            state: InstanceState::Running,
            desired_state: DesiredState::Stopped,
            sandbox_id: None,
            warm_template_id: None,
        })]);
    assert_eq!(inst.state, InstanceState::Running);
    assert_eq!(inst.version, before.version + 1);
}

#[test]
fn start_on_a_stopped_instance_wants_it_running_and_keeps_its_state() {
    let before = state_of(&stopped()).map_or(0, |i| i.starts);
    let inst = given(stopped())
        .when(api_start())
        .then_types(&["instance.starting"]);
    assert_eq!(inst.state, InstanceState::Stopped);
    assert_eq!(inst.desired_state, DesiredState::Running);
    // Each start is counted, so a host tells it from the start it already carried out.
    assert_eq!(inst.starts, before + 1);
}

#[test]
fn starting_what_already_should_run_appends_nothing() {
    given(running()).when(api_start()).then(vec![]);
}

#[test]
fn start_on_a_failed_instance_with_a_host_retries_it() {
    let history = after(&[
        create(),
        place(),
        InstanceCommand::Fail(Failure::Runtime {
            message: "qemu exited".into(),
        }),
    ]);
    let inst = given(history)
        .when(api_start())
        .then_types(&["instance.starting"]);
    assert_eq!(inst.state, InstanceState::Starting);
}

#[test]
fn start_on_an_instance_that_failed_before_placement_is_invalid_state() {
    let history = after(&[
        create(),
        InstanceCommand::Fail(Failure::Runtime {
            message: "no".into(),
        }),
    ]);
    let error = given(history)
        .when(api_start())
        .then_refused(ErrorCode::InvalidState);
    assert!(error.to_string().contains("failed before it was placed"));
}

#[test]
fn start_and_stop_on_an_instance_being_deleted_are_invalid_state() {
    let history = after(&[create(), place(), api_delete()]);
    given(history.clone())
        .when(api_start())
        .then_refused(ErrorCode::InvalidState);
    given(history)
        .when(api_stop())
        .then_refused(ErrorCode::InvalidState);
}

#[test]
fn delete_moves_to_deleting_and_a_second_delete_appends_nothing() {
    let inst = given(running())
        .when(api_delete())
        .then_types(&["instance.deleting"]);
    assert_eq!(inst.state, InstanceState::Deleting);
    assert_eq!(inst.desired_state, DesiredState::Deleted);
    let mut history = running();
    history.extend(after_on(&running(), &[api_delete()]));
    given(history).when(api_delete()).then(vec![]);
}

#[test]
fn a_tenant_teardown_delete_carries_its_reason() {
    let events = given(running())
        .when(InstanceCommand::Delete {
            requester: Requester::System,
            reason: Some("tenant deleted".into()),
        })
        .result
        .unwrap();
    assert_eq!(events[0].data()["reason"], json!("tenant deleted"));
}

#[test]
fn deleting_a_hosted_instance_that_was_never_placed_finishes_at_once() {
    let inst = given(after(&[create()]))
        .when(api_delete())
        .then_types(&["instance.deleting", "instance.deleted"]);
    assert_eq!(inst.state, InstanceState::Deleted);
}

#[test]
fn release_completes_deletion_and_frees_what_it_held() {
    let history = after(&[create(), place(), observe(Observed::Running), api_delete()]);
    let inst = given(history.clone())
        .when(InstanceCommand::Release)
        .then_types(&["instance.deleted"]);
    assert_eq!(inst.state, InstanceState::Deleted);
    assert!(inst.allocation_id.is_none());
    assert!(inst.addresses.is_empty());
    let mut done = history;
    done.extend(after_on(&done.clone(), &[InstanceCommand::Release]));
    given(done.clone())
        .when(InstanceCommand::Release)
        .then(vec![]);
    given(done).when(api_delete()).then(vec![]);
}

#[test]
fn a_node_spec_lists_an_instance_from_placement_until_it_is_deleted() {
    assert!(!state_of(&after(&[create()])).unwrap().listed_in_node_spec());
    assert!(state_of(&running()).unwrap().listed_in_node_spec());
    let deleting = after(&[create(), place(), api_delete()]);
    assert!(state_of(&deleting).unwrap().listed_in_node_spec());
    let deleted = after(&[create(), place(), api_delete(), InstanceCommand::Release]);
    assert!(!state_of(&deleted).unwrap().listed_in_node_spec());
}

#[test]
fn release_before_delete_is_invalid_state() {
    given(running())
        .when(InstanceCommand::Release)
        .then_refused(ErrorCode::InvalidState);
}

/// The events `commands` append on top of `history`.
fn after_on(history: &[InstanceEvent], commands: &[InstanceCommand]) -> Vec<InstanceEvent> {
    let mut all = history.to_vec();
    let start = all.len();
    for cmd in commands {
        let events = given(all.clone()).when(cmd.clone()).result.unwrap();
        all.extend(events);
    }
    all.split_off(start)
}

// ---- sandbox and warm instances ------------------------------------------------------------

#[test]
fn the_api_cannot_move_a_sandbox_instance_and_is_told_which_sandbox() {
    let mut c = create_in(PoolKind::Hosted);
    c.sandbox_id = Some("sbx_owner".into());
    let history = after(&[
        InstanceCommand::Create(Box::new(c)),
        place(),
        observe(Observed::Running),
    ]);
    for cmd in [
        api_start(),
        api_stop(),
        api_delete(),
        resize_to("g1.large", small()),
    ] {
        let error = given(history.clone())
            .when(cmd)
            .then_refused(ErrorCode::InvalidState);
        assert!(error.to_string().contains("sandbox sbx_owner"), "{error}");
    }
    given(history)
        .when(InstanceCommand::Delete {
            requester: Requester::System,
            reason: None,
        })
        .then_types(&["instance.deleting"]);
}

#[test]
fn the_api_cannot_move_a_warm_instance_and_is_told_which_template() {
    let mut c = create_in(PoolKind::Hosted);
    c.warm_template_id = Some("sbxt_tpl".into());
    c.desired_state = DesiredState::Paused;
    let history = after(&[InstanceCommand::Create(Box::new(c)), place()]);
    let error = given(history)
        .when(api_delete())
        .then_refused(ErrorCode::InvalidState);
    assert!(error.to_string().contains("sandbox template sbxt_tpl"));
}

#[test]
fn a_warm_instance_walks_to_paused_and_its_events_carry_the_template() {
    let mut c = create_in(PoolKind::Hosted);
    c.warm_template_id = Some("sbxt_tpl".into());
    c.desired_state = DesiredState::Paused;
    let history = after(&[InstanceCommand::Create(Box::new(c)), place()]);
    let outcome = given(history).when(observe(Observed::Paused));
    let events = outcome.result.clone().unwrap();
    assert!(events
        .iter()
        .all(|e| e.data()["warmTemplateId"] == json!("sbxt_tpl")));
    let inst = outcome.then_types(&["instance.starting", "instance.running", "instance.paused"]);
    assert_eq!(inst.state, InstanceState::Paused);
}

// ---- resize --------------------------------------------------------------------------------

#[test]
fn a_stopped_instance_resizes_and_stays_stopped() {
    let bigger = Shape {
        vcpu: 4,
        memory_gib: 8,
        ..small()
    };
    let inst = given(stopped())
        .when(resize_to("g1.large", bigger.clone()))
        .then_types(&["instance.resized"]);
    assert_eq!(inst.state, InstanceState::Stopped);
    assert_eq!(inst.flavor, "g1.large");
    assert_eq!(inst.shape, bigger);
}

#[test]
fn resize_needs_both_state_and_desired_state_stopped() {
    given(running())
        .when(resize_to("g1.large", small()))
        .then_refused(ErrorCode::InvalidState);
    let mut wanting_to_run = stopped();
    wanting_to_run.extend(after_on(&stopped(), &[api_start()]));
    given(wanting_to_run)
        .when(resize_to("g1.large", small()))
        .then_refused(ErrorCode::InvalidState);
}

#[test]
fn resize_cannot_change_the_gpu_count() {
    let with_gpu = Shape {
        gpus: Some(Gpus {
            model: "l40s".into(),
            count: 1,
        }),
        ..small()
    };
    given(stopped())
        .when(resize_to("g1.gpu", with_gpu))
        .then_refused(ErrorCode::Unsupported);
}

#[test]
fn resize_in_a_provider_pool_is_unsupported() {
    let history = after(&[InstanceCommand::Create(Box::new(create_in(
        PoolKind::Provider,
    )))]);
    given(history)
        .when(resize_to("g1.large", small()))
        .then_refused(ErrorCode::Unsupported);
}

// ---- reports -------------------------------------------------------------------------------

#[test]
fn a_running_report_walks_provisioning_through_starting_to_running() {
    let inst = given(after(&[create(), place()]))
        .when(observe(Observed::Running))
        .then_types(&["instance.starting", "instance.running"]);
    assert_eq!(inst.state, InstanceState::Running);
}

#[test]
fn a_report_that_disagrees_with_the_desired_state_waits() {
    given(running())
        .when(observe(Observed::Stopped))
        .then(vec![]);
    given(running())
        .when(observe(Observed::Running))
        .then(vec![]);
}

#[test]
fn a_stopped_report_settles_a_stop() {
    let mut history = running();
    history.extend(after_on(&running(), &[api_stop()]));
    let inst = given(history)
        .when(observe(Observed::Stopped))
        .then_types(&["instance.stopped"]);
    assert_eq!(inst.state, InstanceState::Stopped);
}

#[test]
fn a_reported_error_fails_the_instance_with_a_runtime_error_once() {
    let fail = InstanceCommand::Fail(Failure::Runtime {
        message: "domain crashed".into(),
    });
    let inst = given(running())
        .when(fail.clone())
        .then_types(&["instance.condition.set", "instance.failed"]);
    assert_eq!(inst.state, InstanceState::Error);
    assert_eq!(
        inst.condition(ConditionType::RuntimeError).unwrap().message,
        "domain crashed"
    );
    let mut history = running();
    history.extend(after_on(&running(), std::slice::from_ref(&fail)));
    given(history).when(fail).then(vec![]);
}

#[test]
fn a_failed_event_names_its_reason() {
    let events = given(running())
        .when(InstanceCommand::Fail(Failure::Provider {
            code: "INVALID_CONFIG".into(),
            message: "bad token".into(),
        }))
        .result
        .unwrap();
    assert_eq!(events[1].data()["reason"], json!("INVALID_CONFIG"));
}

#[test]
fn reported_addresses_are_added_once() {
    let add = InstanceCommand::RecordAddresses {
        addresses: vec!["fe80::1".into(), "10.0.0.2".into()],
        mode: AddressMode::Add,
    };
    let inst = given(running())
        .when(add.clone())
        .then_types(&["instance.addresses.changed"]);
    assert_eq!(
        inst.addresses,
        vec!["10.0.0.2".to_string(), "fe80::1".to_string()]
    );
    let mut history = running();
    history.extend(after_on(&running(), std::slice::from_ref(&add)));
    given(history).when(add).then(vec![]);
}

// ---- hosts that cannot start an instance ---------------------------------------------------

#[test]
fn a_refusal_is_recorded_and_keeps_its_first_time() {
    let history = after(&[create(), place()]);
    let inst = given(history.clone())
        .when(refused_by("node_a"))
        .then_types(&["instance.condition.set"]);
    let since = inst
        .condition(ConditionType::HostResourcesExhausted)
        .unwrap()
        .since;
    let mut again = history;
    again.extend(after_on(&again.clone(), &[refused_by("node_a")]));
    given(again.clone()).when(refused_by("node_a")).then(vec![]);
    let later = state_of(&again).unwrap();
    assert_eq!(
        later
            .condition(ConditionType::HostResourcesExhausted)
            .unwrap()
            .since,
        since
    );
    assert_eq!(
        later.refusal_standing(since + TimeDelta::seconds(59), TimeDelta::seconds(60)),
        None
    );
    assert_eq!(
        later.refusal_standing(since + TimeDelta::seconds(60), TimeDelta::seconds(60)),
        Some("node_a")
    );
}

#[test]
fn a_refusal_from_another_node_is_invalid_state() {
    given(after(&[create(), place()]))
        .when(refused_by("node_b"))
        .then_refused(ErrorCode::InvalidState);
}

#[test]
fn a_refused_instance_is_placed_elsewhere_and_the_refusing_host_is_avoided() {
    let history = after(&[create(), place(), refused_by("node_a")]);
    let now = t0() + TimeDelta::minutes(5);
    let inst = given(history)
        .at(now)
        .when(recreate_exhausted(now))
        .then_types(&[
            "instance.recreating",
            "instance.condition.cleared",
            "instance.condition.set",
        ]);
    assert_eq!(inst.state, InstanceState::Scheduling);
    assert!(inst.node_id.is_none() && inst.allocation_id.is_none());
    assert!(inst.addresses.is_empty());
    assert_eq!(
        inst.condition(ConditionType::ExhaustedHosts)
            .unwrap()
            .message,
        "node_a"
    );
    assert!(inst.excluded_nodes(now).contains("node_a"));
    assert!(inst.excluded_nodes(now + TimeDelta::minutes(11)).is_empty());
}

#[test]
fn after_three_replacements_the_next_refusal_fails_the_instance() {
    let now = t0();
    let mut commands = vec![create()];
    for node in ["node_a", "node_b", "node_c"] {
        commands.extend([place_on(node), refused_by(node), recreate_exhausted(now)]);
    }
    commands.extend([place_on("node_d"), refused_by("node_d")]);
    let history = after(&commands);
    let before = state_of(&history).unwrap();
    assert_eq!(before.refusals.len(), MAX_EXHAUSTED_REPLACEMENTS);
    assert_eq!(
        before
            .condition(ConditionType::ExhaustedHosts)
            .unwrap()
            .message,
        "node_a,node_b,node_c"
    );
    let outcome = given(history).when(recreate_exhausted(now));
    let events = outcome.result.clone().unwrap();
    assert_eq!(events[0].data()["reason"], json!("resources-exhausted"));
    assert_eq!(events[0].data()["nodeId"], json!("node_d"));
    let inst = outcome.then_types(&["instance.failed"]);
    assert_eq!(inst.state, InstanceState::Error);
}

#[test]
fn a_tenants_stopped_instance_is_never_moved_off_its_host() {
    given(stopped())
        .when(recreate_exhausted(t0()))
        .then_refused(ErrorCode::InvalidState);
}

#[test]
fn reaching_the_desired_state_clears_refusal_conditions() {
    let history = after(&[create(), place(), refused_by("node_a")]);
    let inst = given(history)
        .when(observe(Observed::Running))
        .then_types(&[
            "instance.condition.cleared",
            "instance.starting",
            "instance.running",
        ]);
    assert!(inst.conditions.is_empty());
}

// ---- lost hosts ----------------------------------------------------------------------------

#[test]
fn an_instance_on_a_lost_node_is_lost_and_recovers_to_what_the_node_reports() {
    let inst = given(running())
        .when(InstanceCommand::Lose)
        .then_types(&["instance.lost"]);
    assert_eq!(inst.state, InstanceState::Lost);
    let mut history = running();
    history.extend(after_on(&running(), &[InstanceCommand::Lose]));
    given(history.clone())
        .when(InstanceCommand::Lose)
        .then(vec![]);
    let inst = given(history)
        .when(observe(Observed::Stopped))
        .then_types(&["instance.recovered"]);
    assert_eq!(inst.state, InstanceState::Stopped);
}

#[test]
fn a_lost_instance_is_recreated_when_the_pool_says_so() {
    let mut history = running();
    history.extend(after_on(&running(), &[InstanceCommand::Lose]));
    let outcome = given(history).when(InstanceCommand::Recreate(RecreateCause::HostLost));
    let events = outcome.result.clone().unwrap();
    assert_eq!(events[0].data()["reason"], json!("host-lost"));
    assert_eq!(events[0].data()["fromNodeId"], json!("node_a"));
    let inst = outcome.then_types(&["instance.recreating"]);
    assert_eq!(inst.state, InstanceState::Scheduling);
    assert!(inst.refusals.is_empty());
}

#[test]
fn an_unplaced_instance_cannot_be_lost() {
    given(after(&[create()]))
        .when(InstanceCommand::Lose)
        .then_refused(ErrorCode::InvalidState);
}

#[test]
fn deleting_a_lost_hosted_instance_finishes_at_once() {
    let mut history = running();
    history.extend(after_on(&running(), &[InstanceCommand::Lose]));
    given(history)
        .when(api_delete())
        .then_types(&["instance.deleting", "instance.deleted"]);
}

#[test]
fn losing_the_host_of_an_instance_being_deleted_completes_its_deletion() {
    let mut history = running();
    history.extend(after_on(&running(), &[api_delete()]));
    given(history)
        .when(InstanceCommand::Lose)
        .then_types(&["instance.deleted"]);
}

// ---- provider pools ------------------------------------------------------------------------

#[test]
fn the_first_provider_answer_moves_scheduling_to_provisioning_with_the_machine() {
    let history = after(&[InstanceCommand::Create(Box::new(create_in(
        PoolKind::Provider,
    )))]);
    let provisioned = InstanceCommand::Provisioned {
        external_id: "hcloud-42".into(),
        addresses: vec!["203.0.113.7".into()],
    };
    let inst = given(history.clone())
        .when(provisioned.clone())
        .then_types(&["instance.provisioning", "instance.addresses.changed"]);
    assert_eq!(inst.external_id.as_deref(), Some("hcloud-42"));
    assert_eq!(inst.addresses, vec!["203.0.113.7".to_string()]);
    let mut again = history;
    again.extend(after_on(&again.clone(), std::slice::from_ref(&provisioned)));
    given(again).when(provisioned).then(vec![]);
}

#[test]
fn a_provider_instance_is_never_placed_on_a_node() {
    let history = after(&[InstanceCommand::Create(Box::new(create_in(
        PoolKind::Provider,
    )))]);
    given(history)
        .when(place())
        .then_refused(ErrorCode::InvalidState);
}

#[test]
fn a_provider_delete_waits_for_the_provider() {
    let history = after(&[InstanceCommand::Create(Box::new(create_in(
        PoolKind::Provider,
    )))]);
    given(history)
        .when(api_delete())
        .then_types(&["instance.deleting"]);
}

// ---- events on the wire --------------------------------------------------------------------

#[test]
fn every_event_round_trips_through_its_type_and_data() {
    let mut c = create_in(PoolKind::Hosted);
    c.sandbox_id = Some("sbx_owner".into());
    let history = after(&[
        InstanceCommand::Create(Box::new(c)),
        InstanceCommand::MarkUnschedulable(Unschedulable::NoFit),
        place(),
        refused_by("node_a"),
        recreate_exhausted(t0()),
        place_on("node_b"),
        observe(Observed::Running),
        InstanceCommand::RecordAddresses {
            addresses: vec!["fe80::2".into()],
            mode: AddressMode::Add,
        },
        InstanceCommand::Lose,
        observe(Observed::Running),
        InstanceCommand::Stop {
            requester: Requester::System,
        },
        observe(Observed::Stopped),
        InstanceCommand::Delete {
            requester: Requester::System,
            reason: None,
        },
        InstanceCommand::Release,
    ]);
    for event in &history {
        let data = event.data();
        for field in ["state", "desiredState", "poolId", "tenantId", "instanceId"] {
            assert!(
                data.get(field).is_some(),
                "{} lacks {field}",
                event.event_type()
            );
        }
        assert_eq!(data["sandboxId"], json!("sbx_owner"));
        assert!(EVENT_TYPES.contains(&event.event_type()));
        let back = InstanceEvent::from_parts(event.event_type(), data).unwrap();
        assert_eq!(&back, event);
    }
}

#[test]
fn created_data_uses_camel_case_wire_names() {
    let events = given(vec![]).when(create()).result.unwrap();
    let data = events[0].data();
    assert_eq!(data["state"], json!("scheduling"));
    assert_eq!(data["desiredState"], json!("running"));
    assert_eq!(
        data["shape"],
        json!({ "vcpu": 2, "memoryGiB": 4, "diskGiB": 20 })
    );
    assert_eq!(data["poolKind"], json!("hosted"));
    assert!(data.get("sandboxId").is_none());
}

#[test]
fn a_stream_must_start_with_created() {
    let history = running();
    assert!(matches!(
        fold(history[1..].iter().map(|e| (e, t0()))),
        Err(StreamError::NotCreated { .. })
    ));
}

// ---- properties ----------------------------------------------------------------------------

fn any_command() -> impl Strategy<Value = InstanceCommand> {
    let requester = prop::sample::select(vec![Requester::Api, Requester::System]);
    let observed =
        prop::sample::select(vec![Observed::Running, Observed::Stopped, Observed::Paused]);
    let node = prop::sample::select(vec!["node_a", "node_b", "node_c", "node_d"]);
    prop_oneof![
        node.clone().prop_map(place_on),
        Just(InstanceCommand::MarkUnschedulable(Unschedulable::NoFit)),
        requester
            .clone()
            .prop_map(|requester| InstanceCommand::Start { requester }),
        requester
            .clone()
            .prop_map(|requester| InstanceCommand::Stop { requester }),
        requester.prop_map(|requester| InstanceCommand::Delete {
            requester,
            reason: None
        }),
        Just(resize_to("g1.large", Shape { vcpu: 4, ..small() })),
        observed.clone().prop_map(InstanceCommand::Observe),
        observed.prop_map(InstanceCommand::Recover),
        Just(InstanceCommand::Fail(Failure::Runtime {
            message: "boom".into()
        })),
        node.prop_map(refused_by),
        Just(recreate_exhausted(t0())),
        Just(InstanceCommand::Recreate(RecreateCause::HostLost)),
        Just(InstanceCommand::Lose),
        Just(InstanceCommand::Release),
        Just(InstanceCommand::ClearCondition(
            ConditionType::Unschedulable
        )),
    ]
}

proptest! {
    #[test]
    fn any_command_sequence_moves_only_along_the_table_and_folds_to_what_decide_saw(
        commands in prop::collection::vec(any_command(), 0..30),
        warm in any::<bool>(),
    ) {
        let mut c = create_in(PoolKind::Hosted);
        if warm {
            c.warm_template_id = Some("sbxt_tpl".into());
        }
        let mut history = after(&[InstanceCommand::Create(Box::new(c))]);
        for cmd in commands {
            let before = state_of(&history).unwrap();
            // A refused command appends nothing; only accepted ones are checked.
            if let Ok(events) = decide(Some(&before), &cmd, t0()) {
                    let mut state = before.clone();
                    for event in &events {
                        let next = evolve(Some(state.clone()), event, t0()).unwrap();
                        prop_assert!(
                            state.state == next.state || state_table::allows(state.state, next.state),
                            "{:?}: {} → {}", cmd, state.state, next.state
                        );
                        state = next;
                    }
                    history.extend(events);
            }
            let folded = state_of(&history).unwrap();
            prop_assert_eq!(folded.version as usize, history.len());
            prop_assert!(folded.refusals.len() <= MAX_EXHAUSTED_REPLACEMENTS);
        }
    }
}

/// `ReportView::unchanged_by` is only ever right: where it says a report changes nothing,
/// deciding the report's commands on the whole instance appends nothing.
#[test]
fn a_report_the_view_calls_unchanged_decides_no_event() {
    let histories = [
        running(),
        stopped(),
        after(&[create(), place(), observe(Observed::Running), api_stop()]),
        after(&[create(), place(), refused_by("node_a")]),
    ];
    let mut unchanged = 0;
    for history in histories {
        let inst = state_of(&history).expect("an instance");
        let view = ReportView {
            state: inst.state,
            has_conditions: !inst.conditions.is_empty(),
            addresses: inst.addresses.clone(),
            shares_principal: false,
            drives_sandbox: false,
        };
        assert!(!view.rebinds(true), "nothing to rebind");
        for observed in [Observed::Running, Observed::Stopped, Observed::Paused] {
            for reported in [vec![], inst.addresses.clone()] {
                if !view.unchanged_by(observed, &reported) {
                    continue;
                }
                unchanged += 1;
                let commands = [
                    InstanceCommand::Observe(observed),
                    InstanceCommand::RecordAddresses {
                        addresses: reported.clone(),
                        mode: AddressMode::Add,
                    },
                ];
                let events = decide_all(&inst, &commands, t0() + TimeDelta::hours(1)).unwrap();
                assert!(
                    events.is_empty(),
                    "{observed:?} on {:?}: {events:?}",
                    inst.state
                );
            }
        }
    }
    assert!(unchanged >= 4, "the cases cover unchanged reports");
}

// ---- admission asks the caller's policy ----------------------------------------------------

/// A provider pool with room for anything: nothing but the policy refuses a create.
fn provider_facts() -> AdmissionFacts {
    AdmissionFacts {
        pool: Some(AdmissionPool {
            kind: PoolKind::Provider,
            runtime: "libvirt-kvm".into(),
            has_account: true,
            has_range: false,
        }),
        shape: Some(small()),
        image_visible: true,
        image_verified: true,
        quota_max: QuotaResource::ALL.into_iter().map(|r| (r, 100)).collect(),
        ..AdmissionFacts::default()
    }
}

/// A policy that refuses every draft and keeps the drafts it was shown.
fn refusing(
    seen: &Mutex<Vec<(String, InstanceDraft)>>,
) -> impl Fn(&str, &InstanceDraft) -> Result<(), DomainError> + Sync + '_ {
    move |id, draft| {
        seen.lock().unwrap().push((id.to_string(), draft.clone()));
        Err(DomainError::AccessDenied {
            message: "refused".into(),
            details: json!({ "policyIds": ["p"] }),
        })
    }
}

#[test]
fn admission_asks_the_policy_about_the_draft_and_a_refusal_admits_nothing() {
    let seen = Mutex::new(Vec::new());
    let mut command = create_in(PoolKind::Provider);
    command.project_id = Some("proj_1".into());
    let id = command.id.clone();
    let err = admit(
        &provider_facts(),
        command,
        "alloc_1",
        t0(),
        &refusing(&seen),
    )
    .unwrap_err();
    assert_eq!(err.code(), ErrorCode::AccessDenied);
    let seen = seen.into_inner().unwrap();
    let draft = InstanceDraft {
        vcpu: 2,
        memory_gib: 4,
        gpus: 0,
        disk_gib: 20,
        image_id: "ubuntu-24.04".into(),
        image_verified: true,
        project_id: Some("proj_1".into()),
        labels: Default::default(),
    };
    assert_eq!(seen, vec![(id, draft)]);
}

#[test]
fn a_replay_and_a_create_naming_something_missing_are_answered_before_the_policy() {
    let seen = Mutex::new(Vec::new());
    let existing = state_of(&after(&[create()])).unwrap();
    let replay = AdmissionFacts {
        existing: Some(existing),
        ..AdmissionFacts::default()
    };
    let answer = admit(
        &replay,
        create_in(PoolKind::Hosted),
        "alloc_1",
        t0(),
        &refusing(&seen),
    );
    assert!(matches!(answer, Ok(Admission::Replay(_))), "got {answer:?}");
    let missing_image = AdmissionFacts {
        image_visible: false,
        ..provider_facts()
    };
    let err = admit(
        &missing_image,
        create_in(PoolKind::Provider),
        "alloc_1",
        t0(),
        &refusing(&seen),
    )
    .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound);
    assert!(seen.lock().unwrap().is_empty(), "the policy was not asked");
}

// ---- a memory restore's identity ------------------------------------------------------------

#[test]
fn a_memory_restore_answers_as_its_source_until_its_host_rebinds_its_identity() {
    let mut request = create_in(PoolKind::Hosted);
    request.restore_from = Some(RestoreFrom {
        snapshot_id: "snap_1".into(),
        sha256: "00".into(),
        include_memory: true,
        cpu_model: Some("tcg:max".into()),
        principal_instance_id: Some("inst_source".into()),
    });
    let history = after(&[
        InstanceCommand::Create(Box::new(request)),
        place(),
        observe(Observed::Running),
    ]);
    let inst = given(history.clone())
        .when(InstanceCommand::ReboundIdentity)
        .then_types(&["instance.identity.rebound"]);
    let restore = inst.restore_from.expect("still a restore");
    assert_eq!(restore.principal_instance_id, None, "its own identity now");
    assert!(restore.include_memory);
    // Once is enough: a second report of the same rebound appends nothing, and an instance
    // that is no memory restore has nothing to rebind.
    let mut rebound = history;
    rebound.extend(
        decide(
            state_of(&rebound).as_ref(),
            &InstanceCommand::ReboundIdentity,
            t0(),
        )
        .unwrap(),
    );
    given(rebound)
        .when(InstanceCommand::ReboundIdentity)
        .then(vec![]);
    given(running())
        .when(InstanceCommand::ReboundIdentity)
        .then(vec![]);
}
// ---- deadlines and force deletes (issue 40) ------------------------------------------------

fn force(reason: &str) -> InstanceCommand {
    InstanceCommand::ForceDelete {
        requester: Requester::Api,
        reason: reason.into(),
    }
}

#[test]
fn a_force_delete_releases_at_once_and_a_second_appends_nothing() {
    let inst = given(running())
        .when(force("force"))
        .then_types(&["instance.deleting", "instance.deleted"]);
    assert_eq!(inst.state, InstanceState::Deleted);
    assert_eq!(inst.allocation_id, None);
    assert!(inst.addresses.is_empty());
    let mut history = running();
    history.extend(after_on(&running(), &[force("force")]));
    given(history).when(force("force")).then(vec![]);
}

#[test]
fn a_force_delete_finishes_a_delete_that_waits_for_its_host() {
    let mut history = running();
    history.extend(after_on(&running(), &[api_delete()]));
    let events = given(history).when(force("force")).result.unwrap();
    let types: Vec<&str> = events.iter().map(|e| e.event_type()).collect();
    assert_eq!(types, ["instance.deleting", "instance.deleted"]);
    assert_eq!(events[0].data()["reason"], json!("force"));
}

#[test]
fn a_deadline_fails_the_instance_in_the_state_it_names_and_releases_it() {
    let history = after(&[create(), place()]);
    let inst = given(history.clone())
        .when(InstanceCommand::PastDeadline {
            state: "provisioning".into(),
        })
        .then_types(&["instance.failed", "instance.deleting", "instance.deleted"]);
    assert_eq!(inst.state, InstanceState::Deleted);
    let events = given(history.clone())
        .when(InstanceCommand::PastDeadline {
            state: "provisioning".into(),
        })
        .result
        .unwrap();
    assert_eq!(events[0].data()["reason"], json!("deadline:provisioning"));
    // A deadline of a state it has left since decides nothing.
    given(history)
        .when(InstanceCommand::PastDeadline {
            state: "starting".into(),
        })
        .then(vec![]);
}

#[test]
fn a_stop_that_never_lands_is_a_stopping_instance() {
    let mut history = running();
    history.extend(after_on(&running(), &[api_stop()]));
    let inst = given(history.clone()).when(api_stop()).then_types(&[]);
    let (state, _) = inst.transitional().expect("stopping");
    assert_eq!(state, "stopping");
    given(history)
        .when(InstanceCommand::PastDeadline {
            state: "stopping".into(),
        })
        .then_types(&["instance.failed", "instance.deleting", "instance.deleted"]);
}
