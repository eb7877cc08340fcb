use chrono::{TimeDelta, TimeZone, Utc};

use super::*;
use crate::aggregate::fold;

fn at(s: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
}

fn request(ttl: Option<u64>) -> CreateSandbox {
    CreateSandbox {
        id: "sbx_a".into(),
        tenant_id: "acme".into(),
        template_id: "sbxt_t".into(),
        ttl_seconds: ttl,
        idempotency_key: "k".into(),
        request_hash: "h".into(),
        owner_identity_id: "id_alice".into(),
        from_snapshot: None,
    }
}

fn ids() -> Lifecycle {
    Lifecycle {
        sandbox_id: "sbx_a".into(),
        tenant_id: "acme".into(),
        template_id: "sbxt_t".into(),
        instance_id: "inst_i".into(),
        pool_id: "pool_p".into(),
    }
}

fn sandbox(ttl: u64) -> Sandbox {
    let event = created_event(&request(Some(ttl)), ids(), true, ttl, at(0));
    fold::<Sandbox>([(&event, at(0))]).unwrap().unwrap()
}

#[test]
fn a_create_within_the_bounds_is_admitted_with_the_default_lifetime() {
    match admit(None, &request(None), 600, 3600).unwrap() {
        Admit::New { ttl_seconds } => assert_eq!(ttl_seconds, 600),
        other => panic!("{other:?}"),
    }
    for ttl in [0, 3601] {
        let err = admit(None, &request(Some(ttl)), 600, 3600).unwrap_err();
        assert_eq!(err.code(), "INVALID_INPUT", "ttl {ttl}");
    }
}

#[test]
fn a_key_replays_its_sandbox_and_conflicts_for_another_request() {
    let s = sandbox(60);
    assert!(matches!(
        admit(Some(&s), &request(Some(60)), 60, 60).unwrap(),
        Admit::Replay(_)
    ));
    let mut other = request(Some(60));
    other.request_hash = "different".into();
    let err = admit(Some(&s), &other, 60, 60).unwrap_err();
    assert_eq!(err.code(), "CONFLICT");
    assert_eq!(err.details()["sandboxId"], "sbx_a");
}

#[test]
fn the_lifetime_counts_from_admission_and_an_extend_is_bounded_by_the_template() {
    let s = sandbox(600);
    assert_eq!(s.expires_at, at(600));
    let by = extended_expiry(&s, Extension::By(TimeDelta::seconds(300)), 3600).unwrap();
    assert_eq!(by, Some(at(900)));
    let too_long = extended_expiry(&s, Extension::By(TimeDelta::seconds(3001)), 3600);
    assert_eq!(too_long.unwrap_err().code(), "INVALID_INPUT");
    assert_eq!(
        extended_expiry(&s, Extension::Until(at(100)), 3600).unwrap(),
        None,
        "an until before the expiry changes nothing"
    );
    let month = extended_expiry(&s, Extension::By(TimeDelta::days(31)), 90 * 86_400);
    assert_eq!(month.unwrap_err().code(), "INVALID_INPUT");
}

#[test]
fn expiring_is_sent_once_per_expiry_then_expired_starts_deletion() {
    let (lead, min) = (TimeDelta::seconds(300), TimeDelta::seconds(30));
    let mut s = sandbox(600);
    assert!(
        expiry(&s, at(400), lead, min).is_empty(),
        "lead is a quarter: 150 s"
    );
    let warned = expiry(&s, at(460), lead, min);
    assert!(matches!(warned[..], [SandboxEvent::Expiring(_)]));
    s = Sandbox::evolve(Some(s), &warned[0], at(460)).unwrap();
    assert!(expiry(&s, at(470), lead, min).is_empty(), "once per expiry");
    let extended = extend(&s, at(1200));
    s = Sandbox::evolve(Some(s), &extended[0], at(470)).unwrap();
    assert!(!s.expiring_sent, "an extend re-arms the warning");
    let expired = expiry(&s, at(1200), lead, min);
    s = Sandbox::evolve(Some(s), &expired[0], at(1200)).unwrap();
    assert_eq!((s.state, s.expired), (SandboxState::Deleting, true));
    let done = deleted(&s);
    s = Sandbox::evolve(Some(s), &done[0], at(1201)).unwrap();
    assert_eq!(s.state, SandboxState::Deleted);
    assert!(
        delete(&s).is_empty(),
        "a delete of a deleted sandbox is a no-op"
    );
}

#[test]
fn the_lead_is_a_quarter_of_a_short_life_but_never_under_the_minimum() {
    let (lead, min) = (TimeDelta::seconds(300), TimeDelta::seconds(30));
    assert_eq!(expiring_lead(TimeDelta::hours(2), lead, min), lead);
    assert_eq!(
        expiring_lead(TimeDelta::seconds(400), lead, min),
        TimeDelta::seconds(100)
    );
    assert_eq!(expiring_lead(TimeDelta::seconds(60), lead, min), min);
    assert_eq!(
        expiring_lead(TimeDelta::seconds(10), lead, min),
        TimeDelta::seconds(10)
    );
}

#[test]
fn ready_and_failed_follow_the_table() {
    let s = sandbox(60);
    let ready_events = ready(&s);
    let r = Sandbox::evolve(Some(s), &ready_events[0], at(1)).unwrap();
    assert_eq!((r.state, r.ready_at), (SandboxState::Ready, Some(at(1))));
    assert!(ready(&r).is_empty(), "ready once");
    let f = fail(&r, "runtime-error");
    let failed = Sandbox::evolve(Some(r), &f[0], at(2)).unwrap();
    assert_eq!(failed.state, SandboxState::Failed);
    assert_eq!(
        transition(SandboxState::Deleted, Verb::Ready)
            .unwrap_err()
            .code(),
        "INVALID_STATE"
    );
}

#[test]
fn durations_parse_in_the_units_people_write() {
    assert_eq!(parse_duration("15m").unwrap(), TimeDelta::minutes(15));
    assert_eq!(parse_duration("8h").unwrap(), TimeDelta::hours(8));
    assert_eq!(parse_duration("7d").unwrap(), TimeDelta::days(7));
    assert_eq!(
        parse_duration("1500").unwrap(),
        TimeDelta::milliseconds(1500)
    );
    assert!(parse_duration("soon").is_err());
    assert!(parse_duration("5y").is_err());
}
