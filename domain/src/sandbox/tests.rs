use chrono::{TimeDelta, TimeZone, Utc};

use super::*;
use crate::aggregate::fold;
use crate::error::ErrorCode;

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
        on_timeout: None,
        labels: Default::default(),
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
    assert_eq!(admit(&request(None), 600, 3600).unwrap(), 600);
    for ttl in [0, 3601] {
        let err = admit(&request(Some(ttl)), 600, 3600).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidInput, "ttl {ttl}");
    }
}

#[test]
fn a_key_replays_its_sandbox_and_conflicts_for_another_request() {
    let s = sandbox(60);
    assert_eq!(replay(&s, &request(Some(60))).unwrap(), s);
    let mut other = request(Some(60));
    other.request_hash = "different".into();
    let err = replay(&s, &other).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    assert_eq!(err.details()["sandboxId"], "sbx_a");
}

#[test]
fn the_lifetime_counts_from_admission_and_an_extend_is_bounded_by_the_template() {
    let s = sandbox(600);
    assert_eq!(s.expires_at, at(600));
    let by = extended_expiry(&s, Extension::By(TimeDelta::seconds(300)), 3600).unwrap();
    assert_eq!(by, Some(at(900)));
    let too_long = extended_expiry(&s, Extension::By(TimeDelta::seconds(3001)), 3600);
    assert_eq!(too_long.unwrap_err().code(), ErrorCode::InvalidInput);
    assert_eq!(
        extended_expiry(&s, Extension::Until(at(100)), 3600).unwrap(),
        None,
        "an until before the expiry changes nothing"
    );
    let month = extended_expiry(&s, Extension::By(TimeDelta::days(31)), 90 * 86_400);
    assert_eq!(month.unwrap_err().code(), ErrorCode::InvalidInput);
}

#[test]
fn expiring_is_sent_once_per_expiry_then_expired_starts_deletion() {
    let (lead, min) = (TimeDelta::seconds(300), TimeDelta::seconds(30));
    let mut s = sandbox(600);
    assert!(
        expiry(&s, at(400), lead, min, None).is_empty(),
        "lead is a quarter: 150 s"
    );
    let warned = expiry(&s, at(460), lead, min, None);
    assert!(matches!(warned[..], [SandboxEvent::Expiring(_)]));
    s = Sandbox::evolve(Some(s), &warned[0], at(460)).unwrap();
    assert!(
        expiry(&s, at(470), lead, min, None).is_empty(),
        "once per expiry"
    );
    let extended = extend(&s, at(1200));
    s = Sandbox::evolve(Some(s), &extended[0], at(470)).unwrap();
    assert!(!s.expiring_sent, "an extend re-arms the warning");
    let expired = expiry(&s, at(1200), lead, min, None);
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
        ErrorCode::InvalidState
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

fn step(s: Sandbox, events: &[SandboxEvent], t: i64) -> Sandbox {
    events
        .iter()
        .fold(s, |s, e| Sandbox::evolve(Some(s), e, at(t)).unwrap())
}

#[test]
fn pause_stops_the_clock_and_resume_gives_a_fresh_lifetime() {
    let s = sandbox(600);
    let s = step(s.clone(), &ready(&s), 1);
    let pausing = pause(&s, true, 7200, at(100)).unwrap();
    assert!(matches!(pausing[..], [SandboxEvent::Pausing(_)]));
    let s = step(s, &pausing, 100);
    assert_eq!((s.state, s.expires_at), (SandboxState::Pausing, at(7300)));
    assert!(
        pause(&s, true, 7200, at(101)).unwrap().is_empty(),
        "idempotent"
    );
    let s = step(s.clone(), &paused(&s), 102);
    assert_eq!(s.state, SandboxState::Paused);
    // The paused sandbox's own lifetime ends it, with its reason.
    let (lead, min) = (TimeDelta::seconds(300), TimeDelta::seconds(30));
    assert!(
        expiry(&s, at(700), lead, min, None).is_empty(),
        "the TTL clock stopped"
    );
    let extend = extended_expiry(&s, Extension::By(TimeDelta::seconds(60)), 3600);
    assert_eq!(extend.unwrap_err().details()["state"], "paused");
    let resuming = resume(&s, 900, at(200)).unwrap();
    let s = step(s, &resuming, 200);
    assert_eq!((s.state, s.expires_at), (SandboxState::Resuming, at(1100)));
    assert!(resume(&s, 900, at(201)).unwrap().is_empty(), "idempotent");
    let resumed = ready(&s);
    assert!(matches!(resumed[..], [SandboxEvent::Resumed(_)]));
    let s = step(s, &resumed, 202);
    assert_eq!(s.state, SandboxState::Ready);
    // The lifetime bound counts from the resume.
    assert!(extended_expiry(&s, Extension::Until(at(200 + 3600)), 3600)
        .unwrap()
        .is_some());
}

#[test]
fn a_paused_sandbox_ends_with_its_paused_ttl_and_a_deleted_one_cannot_resume() {
    let s = sandbox(600);
    let s = step(s.clone(), &pause(&s, true, 60, at(10)).unwrap(), 10);
    let s = step(s.clone(), &paused(&s), 11);
    let (lead, min) = (TimeDelta::seconds(300), TimeDelta::seconds(30));
    let ended = expiry(&s, at(70), lead, min, Some(TimeDelta::seconds(60)));
    let SandboxEvent::Expired(e) = &ended[0] else {
        panic!("{ended:?}")
    };
    assert_eq!(
        (e.action, e.reason.as_deref()),
        (Some(ExpiryAction::Deleted), Some("paused-ttl"))
    );
    let s = step(s, &ended, 70);
    assert_eq!(s.state, SandboxState::Deleting);
    let s = step(s.clone(), &deleted(&s), 71);
    let SandboxEvent::Deleted(d) = &deleted(&sandbox(1))[0] else {
        unreachable!()
    };
    assert_eq!(d.reason, None);
    assert_eq!(s.reason.as_deref(), Some("paused-ttl"));
    assert_eq!(
        resume(&s, 60, at(72)).unwrap_err().code(),
        ErrorCode::InvalidState
    );
}

#[test]
fn a_runtime_that_cannot_pause_is_unsupported_and_on_timeout_pause_pauses() {
    let s = sandbox(60);
    assert_eq!(
        pause(&s, false, 60, at(1)).unwrap_err().code(),
        ErrorCode::Unsupported
    );
    let mut s = step(s.clone(), &ready(&s), 1);
    s.on_timeout = OnTimeout::Pause;
    let (lead, min) = (TimeDelta::seconds(300), TimeDelta::seconds(30));
    let ended = expiry(&s, at(60), lead, min, Some(TimeDelta::seconds(600)));
    let [SandboxEvent::Expired(e), SandboxEvent::Pausing(p)] = &ended[..] else {
        panic!("{ended:?}")
    };
    assert_eq!(e.action, Some(ExpiryAction::Paused));
    assert_eq!(p.expires_at, at(660));
    let s = step(s, &ended, 60);
    assert_eq!((s.state, s.expired), (SandboxState::Pausing, false));
    // Without a pausing runtime (no paused TTL given) the expiry deletes.
    let mut r = sandbox(60);
    r.on_timeout = OnTimeout::Pause;
    let ended = expiry(&r, at(60), lead, min, None);
    assert!(
        matches!(&ended[..], [SandboxEvent::Expired(e)] if e.action == Some(ExpiryAction::Deleted))
    );
}

#[test]
fn a_sandbox_past_its_deadline_fails_naming_the_state_and_stays_failed() {
    let d = Deadlines {
        starting: TimeDelta::seconds(60),
        pausing: TimeDelta::seconds(30),
        resuming: TimeDelta::seconds(30),
    };
    let s = sandbox(3600);
    assert!(deadline(&s, at(59), &d).is_empty());
    let failed = deadline(&s, at(60), &d);
    let s = step(s, &failed, 60);
    assert_eq!(
        (s.state, s.reason.as_deref()),
        (SandboxState::Failed, Some("deadline:starting"))
    );
    assert!(
        deleted(&s).is_empty(),
        "its instance's release leaves it failed"
    );
    // A delete still ends it.
    let s = step(s.clone(), &delete(&s), 61);
    let s = step(s.clone(), &deleted(&s), 62);
    assert_eq!(s.state, SandboxState::Deleted);
    // The clock counts from entering the state.
    let r = sandbox(3600);
    let r = step(r.clone(), &ready(&r), 100);
    let r = step(r.clone(), &pause(&r, true, 60, at(200)).unwrap(), 200);
    assert!(deadline(&r, at(229), &d).is_empty());
    let SandboxEvent::Failed(f) = &deadline(&r, at(230), &d)[0] else {
        panic!()
    };
    assert_eq!(f.reason, "deadline:pausing");
}

#[test]
fn an_idle_sandbox_pauses_with_its_reason_or_expires_and_only_when_ready() {
    let starting = sandbox(600);
    let ttl = Some(TimeDelta::seconds(3600));
    assert!(idle(&starting, at(5), ttl).is_empty(), "not ready yet");
    let ready_one = step(starting.clone(), &ready(&starting), 1);

    // onTimeout: delete (the default): expired, reason idle.
    let expired = idle(&ready_one, at(100), ttl);
    let [SandboxEvent::Expired(e)] = &expired[..] else {
        panic!("{expired:?}")
    };
    assert_eq!(
        (e.action, e.reason.as_deref()),
        (Some(ExpiryAction::Deleted), Some(IDLE))
    );
    let gone = step(ready_one.clone(), &expired, 100);
    assert_eq!(
        (gone.state, gone.reason.as_deref()),
        (SandboxState::Deleting, Some(IDLE))
    );

    // onTimeout: pause: pausing then paused, both naming idle; a resume forgets it.
    let mut pausing_one = ready_one.clone();
    pausing_one.on_timeout = OnTimeout::Pause;
    let pausing = idle(&pausing_one, at(100), ttl);
    let [SandboxEvent::Pausing(p)] = &pausing[..] else {
        panic!("{pausing:?}")
    };
    assert_eq!((p.reason.as_deref(), p.expires_at), (Some(IDLE), at(3700)));
    let s = step(pausing_one.clone(), &pausing, 100);
    assert!(idle(&s, at(200), ttl).is_empty(), "already pausing");
    let done = paused(&s);
    let [SandboxEvent::Paused(p)] = &done[..] else {
        panic!("{done:?}")
    };
    assert_eq!(p.reason.as_deref(), Some(IDLE));
    let s = step(s, &done, 101);
    let s = step(s.clone(), &resume(&s, 600, at(200)).unwrap(), 200);
    assert_eq!(s.pause_reason, None);

    // A runtime that cannot pause expires it instead.
    let expired = idle(&pausing_one, at(100), None);
    assert!(matches!(expired[..], [SandboxEvent::Expired(_)]));
}
