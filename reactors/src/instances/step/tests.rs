//! One row per situation of the hosted reconciler: the instance, what the pass read, and the
//! command and next look it must come to.

use std::time::Duration;

use chrono::TimeDelta;
use vps_domain::condition::ConditionType;
use vps_domain::instance::{Instance, InstanceCommand, PlaceInstance, PoolKind, RecreateCause};
use vps_domain::placement::Unschedulable;
use vps_domain::state_table::{DesiredState, InstanceState};

use super::{step, wants_pass, HostedFacts, Placement};
use crate::fixtures::{now, with_condition};
use crate::timings::Timings;
use crate::work_queue::Next;

fn instance(state: InstanceState, desired: DesiredState) -> Instance {
    crate::fixtures::instance(PoolKind::Hosted, state, desired)
}

fn facts() -> HostedFacts {
    HostedFacts {
        recreate_on_host_loss: false,
        placement: None,
        tenant_runs_there: false,
    }
}

fn place() -> InstanceCommand {
    InstanceCommand::Place(PlaceInstance {
        node_id: "node_a".into(),
        allocation_id: "alloc_1".into(),
        address: "10.0.0.5".into(),
    })
}

/// A running-wanted instance on `node_a` whose host refused it `ago` before now.
fn refused(ago: TimeDelta) -> Instance {
    let mut inst = instance(InstanceState::Provisioning, DesiredState::Running);
    inst.node_id = Some("node_a".into());
    with_condition(
        inst,
        ConditionType::HostResourcesExhausted,
        "node_a",
        now() - ago,
    )
}

struct Row {
    name: &'static str,
    inst: Instance,
    facts: HostedFacts,
    command: Option<InstanceCommand>,
    next: Next,
}

fn scheduling(t: &Timings) -> Vec<Row> {
    vec![
        Row {
            name: "scheduling, placed: record the placement, wait for the host",
            inst: instance(InstanceState::Scheduling, DesiredState::Running),
            facts: HostedFacts {
                placement: Some(Placement::Decided(place())),
                ..facts()
            },
            command: Some(place()),
            next: Next::WhenWoken,
        },
        Row {
            name: "scheduling, no fit: mark it unschedulable, retry",
            inst: instance(InstanceState::Scheduling, DesiredState::Running),
            facts: HostedFacts {
                placement: Some(Placement::Decided(InstanceCommand::MarkUnschedulable(
                    Unschedulable::NoFit,
                ))),
                ..facts()
            },
            command: Some(InstanceCommand::MarkUnschedulable(Unschedulable::NoFit)),
            next: Next::After(t.unschedulable_retry()),
        },
        Row {
            name: "scheduling, no free address: record nothing, retry",
            inst: instance(InstanceState::Scheduling, DesiredState::Running),
            facts: HostedFacts {
                placement: Some(Placement::NoAddress),
                ..facts()
            },
            command: None,
            next: Next::After(t.unschedulable_retry()),
        },
    ]
}

fn lost(t: &Timings) -> Vec<Row> {
    vec![
        Row {
            name: "lost, the pool recreates on host loss: recreate at once",
            inst: instance(InstanceState::Lost, DesiredState::Running),
            facts: HostedFacts {
                recreate_on_host_loss: true,
                ..facts()
            },
            command: Some(InstanceCommand::Recreate(RecreateCause::HostLost)),
            next: Next::After(Duration::ZERO),
        },
        Row {
            name: "lost, the pool does not recreate: look again later",
            inst: instance(InstanceState::Lost, DesiredState::Running),
            facts: facts(),
            command: None,
            next: Next::After(t.lost_look()),
        },
        Row {
            name: "lost and being deleted: never recreated",
            inst: instance(InstanceState::Lost, DesiredState::Deleted),
            facts: HostedFacts {
                recreate_on_host_loss: true,
                ..facts()
            },
            command: None,
            next: Next::After(t.lost_look()),
        },
    ]
}

fn refused_by_its_host(t: &Timings) -> Vec<Row> {
    let exclude_until = now() + TimeDelta::from_std(t.refusing_node_exclusion()).unwrap();
    vec![
        Row {
            name: "refused before replacement_wait: look again when it has stood long enough",
            inst: refused(TimeDelta::seconds(20)),
            facts: facts(),
            command: None,
            next: Next::After(t.replacement_wait() - Duration::from_secs(20)),
        },
        Row {
            name: "refused past replacement_wait: re-place it away from the host",
            inst: refused(TimeDelta::seconds(90)),
            facts: facts(),
            command: Some(InstanceCommand::Recreate(
                RecreateCause::ResourcesExhausted { exclude_until },
            )),
            next: Next::After(Duration::ZERO),
        },
        Row {
            name: "refused past replacement_wait, the tenant runs there: leave it",
            inst: refused(TimeDelta::seconds(90)),
            facts: HostedFacts {
                tenant_runs_there: true,
                ..facts()
            },
            command: None,
            next: Next::After(t.transitional_look()),
        },
    ]
}

fn placed() -> Vec<Row> {
    vec![
        Row {
            name: "settled: only when woken",
            inst: instance(InstanceState::Running, DesiredState::Running),
            facts: facts(),
            command: None,
            next: Next::WhenWoken,
        },
        Row {
            name: "on its way: the host's report wakes it",
            inst: instance(InstanceState::Starting, DesiredState::Running),
            facts: facts(),
            command: None,
            next: Next::WhenWoken,
        },
        Row {
            name: "deleted: only when woken",
            inst: instance(InstanceState::Deleted, DesiredState::Deleted),
            facts: facts(),
            command: None,
            next: Next::WhenWoken,
        },
        Row {
            name: "error: only when woken",
            inst: instance(InstanceState::Error, DesiredState::Running),
            facts: facts(),
            command: None,
            next: Next::WhenWoken,
        },
    ]
}

#[test]
fn every_hosted_situation_comes_to_its_command_and_next_look() {
    let timings = Timings::default();
    for row in rows(&timings) {
        let (command, next) = step(&row.inst, row.facts, now(), &timings);
        assert_eq!(command, row.command, "{}", row.name);
        assert_eq!(next, row.next, "{}", row.name);
    }
}

fn rows(timings: &Timings) -> impl Iterator<Item = Row> {
    [
        scheduling(timings),
        lost(timings),
        refused_by_its_host(timings),
        placed(),
    ]
    .into_iter()
    .flatten()
}

/// The waker leaves an instance alone exactly when, whatever a pass read, it would record
/// nothing and only wait to be woken.
#[test]
fn a_pass_is_wanted_exactly_when_it_could_do_something() {
    let timings = Timings::default();
    for row in rows(&timings) {
        let idle = row.command.is_none() && row.next == Next::WhenWoken;
        assert_eq!(
            wants_pass(&row.inst, now(), &timings),
            !idle,
            "{}",
            row.name
        );
    }
}
