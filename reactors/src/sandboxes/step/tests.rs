//! One row per situation of the sandbox reconciler: given a sandbox's events and its
//! instance's state, when a pass looks at a time, then the work it does.

use chrono::{DateTime, TimeDelta, Utc};
use vps_domain::aggregate::Aggregate;
use vps_domain::sandbox::{self as domain, CreateSandbox, Lifecycle, Sandbox, SandboxEvent};
use vps_domain::state_table::InstanceState;

use super::{deadlines, expiry_leads, step, wants_pass, Action, Look};
use crate::timings::Timings;

/// Seconds after the sandbox's admission.
fn at(s: i64) -> DateTime<Utc> {
    crate::fixtures::now() + TimeDelta::seconds(s)
}

/// One decision on the sandbox as it stands, taken at a second after admission.
type Decide = fn(&Sandbox, DateTime<Utc>) -> Vec<SandboxEvent>;

fn ready(s: &Sandbox, _: DateTime<Utc>) -> Vec<SandboxEvent> {
    domain::ready(s)
}

fn pause(s: &Sandbox, now: DateTime<Utc>) -> Vec<SandboxEvent> {
    domain::pause(s, true, 600, now).unwrap_or_default()
}

fn warn(s: &Sandbox, now: DateTime<Utc>) -> Vec<SandboxEvent> {
    let (lead, min_lead) = expiry_leads(&Timings::default());
    domain::expiry(s, now, lead, min_lead, None)
}

fn miss_deadline(s: &Sandbox, now: DateTime<Utc>) -> Vec<SandboxEvent> {
    domain::deadline(s, now, &deadlines(&Timings::default()))
}

fn delete(s: &Sandbox, _: DateTime<Utc>) -> Vec<SandboxEvent> {
    domain::delete(s)
}

fn deleted(s: &Sandbox, _: DateTime<Utc>) -> Vec<SandboxEvent> {
    domain::deleted(s)
}

/// Given: a sandbox admitted at second 0 with an hour to live, then each decision at its
/// second.
fn given(decisions: &[(i64, Decide)]) -> Sandbox {
    let create = CreateSandbox {
        id: "sbx_a".into(),
        tenant_id: "acme".into(),
        template_id: "sbxt_t".into(),
        ttl_seconds: Some(3600),
        idempotency_key: "k".into(),
        request_hash: "h".into(),
        owner_identity_id: "id_alice".into(),
        from_snapshot: None,
        on_timeout: None,
        labels: Default::default(),
    };
    let ids = Lifecycle {
        sandbox_id: "sbx_a".into(),
        tenant_id: "acme".into(),
        template_id: "sbxt_t".into(),
        instance_id: "inst_i".into(),
        pool_id: "pool_p".into(),
    };
    let created = domain::created_event(&create, ids, false, 3600, at(0));
    let mut s = Sandbox::evolve(None, &created, at(0)).expect("a sandbox.created folds");
    for (second, decide) in decisions {
        let events = decide(&s, at(*second));
        assert!(
            !events.is_empty(),
            "the given decision at {second}s decided nothing"
        );
        for event in &events {
            s = Sandbox::evolve(Some(s), event, at(*second)).expect("a decided event folds");
        }
    }
    s
}

struct Row {
    name: &'static str,
    given: Sandbox,
    instance: Option<InstanceState>,
    when: i64,
    then: Vec<Action>,
}

fn rows() -> Vec<Row> {
    use Action::{Expire, FailPastDeadline, Settle};
    use InstanceState::{Deleted, Paused, Provisioning, Running};
    vec![
        Row {
            name: "ready and running mid-life: nothing",
            given: given(&[(10, ready)]),
            instance: Some(Running),
            when: 1800,
            then: vec![],
        },
        Row {
            name: "ready, inside the warning's lead: warn",
            given: given(&[(10, ready)]),
            instance: Some(Running),
            when: 3300,
            then: vec![Expire],
        },
        Row {
            name: "ready, warned already: nothing until it expires",
            given: given(&[(10, ready), (3300, warn)]),
            instance: Some(Running),
            when: 3599,
            then: vec![],
        },
        Row {
            name: "ready, its lifetime over: expire",
            given: given(&[(10, ready), (3300, warn)]),
            instance: Some(Running),
            when: 3600,
            then: vec![Expire],
        },
        Row {
            name: "starting within its deadline: nothing",
            given: given(&[]),
            instance: Some(Provisioning),
            when: 599,
            then: vec![],
        },
        Row {
            name: "starting past its deadline: fail it",
            given: given(&[]),
            instance: Some(Provisioning),
            when: 600,
            then: vec![FailPastDeadline],
        },
        Row {
            name: "starting while its instance runs (the stamp was missed): settle",
            given: given(&[]),
            instance: Some(Running),
            when: 10,
            then: vec![Settle],
        },
        Row {
            name: "pausing while its instance is paused: settle",
            given: given(&[(10, ready), (20, pause)]),
            instance: Some(Paused),
            when: 30,
            then: vec![Settle],
        },
        Row {
            name: "pausing while its instance still runs: nothing yet",
            given: given(&[(10, ready), (20, pause)]),
            instance: Some(Running),
            when: 30,
            then: vec![],
        },
        Row {
            name: "ready, its instance gone: settle",
            given: given(&[(10, ready)]),
            instance: None,
            when: 20,
            then: vec![Settle],
        },
        Row {
            name: "failed by its deadline, its instance released: it stays failed",
            given: given(&[(600, miss_deadline)]),
            instance: Some(Deleted),
            when: 700,
            then: vec![],
        },
        Row {
            name: "deleted, long past its lifetime: nothing",
            given: given(&[(10, ready), (20, delete), (30, deleted)]),
            instance: None,
            when: 7200,
            then: vec![],
        },
        Row {
            name: "starting past its lifetime and deadline, its instance gone: all three, in order",
            given: given(&[]),
            instance: None,
            when: 3600,
            then: vec![Expire, FailPastDeadline, Settle],
        },
    ]
}

#[test]
fn each_situation_comes_to_its_work() {
    let timings = Timings::default();
    for row in rows() {
        let look = Look {
            sandbox: row.given,
            instance: row.instance,
        };
        assert_eq!(
            step(&look, at(row.when), &timings),
            row.then,
            "{}",
            row.name
        );
    }
}

#[test]
fn a_pass_is_wanted_exactly_when_it_would_do_something() {
    let timings = Timings::default();
    for row in rows() {
        let look = Look {
            sandbox: row.given,
            instance: row.instance,
        };
        let wanted = wants_pass(&look, at(row.when), &timings);
        assert_eq!(wanted, !row.then.is_empty(), "{}", row.name);
    }
}
