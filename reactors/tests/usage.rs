//! The metering reactor on a real database, fed instance events appended directly to the log
//! (sandboxes, which claim warm instances, are not built on this branch).

mod support;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use sqlx::PgPool;
use vps_domain::usage::window::{at, micros};
use vps_domain::usage::Windows;
use vps_events::{ExpectedVersion, Metadata, NewEvent, Notifier, RecordedEvent};
use vps_reactors::usage::Metering;

use support::{fresh_log, PATIENCE};

const STREAM: &str = "instance-inst_warm";

/// `base` with `extra`'s fields written over it.
fn merged(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

/// An instance event's data: the warm instance's fields, with `extra`'s over them.
fn instance_data(extra: Value) -> Value {
    let base = json!({ "instanceId": "inst_warm", "tenantId": "acme", "poolId": "pool_h",
                       "state": "stopped", "desiredState": "stopped" });
    merged(base, extra)
}

/// `instance.created`'s fields for a 2-vCPU hosted instance, with `extra`'s over them.
fn created_data(extra: Value) -> Value {
    let base = json!({ "poolKind": "hosted", "flavor": "small",
                       "shape": { "vcpu": 2, "memoryGiB": 4, "diskGiB": 20 },
                       "imageId": "img", "sshKeys": [], "idempotencyKey": "k",
                       "requestHash": "h" });
    merged(base, extra)
}

/// A new event with a fresh id.
fn new_event(event_type: &str, data: Value) -> NewEvent {
    NewEvent {
        id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
        event_type: event_type.into(),
        data,
        metadata: Metadata::default(),
    }
}

async fn append(pool: &PgPool, event_type: &str, extra: Value) -> RecordedEvent {
    let event = new_event(event_type, instance_data(extra));
    let mut tx = pool.begin().await.unwrap();
    let stored = vps_events::append(&mut tx, STREAM, ExpectedVersion::Any, &[event])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    stored.into_iter().next().unwrap()
}

/// A fresh log and its metering, with 0.2 s windows.
async fn metering() -> (PgPool, Windows, Metering) {
    let pool = fresh_log().await;
    let windows = Windows::from_seconds(0.2).unwrap();
    let metering = Metering::load(pool.clone(), &Notifier::local_only(), windows)
        .await
        .unwrap();
    (pool, windows, metering)
}

/// `instance.created` of a 2-vCPU hosted instance, with `extra` fields.
async fn created(pool: &PgPool, extra: Value) -> RecordedEvent {
    append(pool, "instance.created", created_data(extra)).await
}

/// Waits (polling the clock) until `time` has passed.
async fn after(time: DateTime<Utc>) {
    support::eventually("time passes", PATIENCE, || async {
        vps_clock::Clock::system().now() > time
    })
    .await;
}

/// Runs metering passes until every window ending by `time` is recorded.
async fn meter_past(metering: &mut Metering, pool: &PgPool, time: DateTime<Utc>) {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        metering.pass().await.unwrap();
        let until: Option<DateTime<Utc>> =
            sqlx::query_scalar("SELECT settled_until FROM usage_progress")
                .fetch_optional(pool)
                .await
                .unwrap();
        if until.is_some_and(|u| u >= time) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "settled until {until:?}"
        );
        tokio::time::sleep(support::POLL).await;
    }
}

/// `(meter, identity, start, end, quantity)` of every record, in window order.
type Row = (
    String,
    Option<String>,
    DateTime<Utc>,
    DateTime<Utc>,
    Decimal,
);

async fn records(pool: &PgPool) -> Vec<Row> {
    sqlx::query_as(
        "SELECT meter, identity_id, window_start, window_end, quantity FROM usage_records
          ORDER BY window_start, meter",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

fn hours(rate: i64, from: DateTime<Utc>, to: DateTime<Utc>) -> Decimal {
    let micros = (to - from).num_microseconds().unwrap();
    (Decimal::from(rate * micros) / Decimal::from(3_600_000_000i64)).round_dp(12)
}

#[tokio::test]
async fn a_warm_instance_claimed_mid_window_bills_warm_to_the_tenant_then_the_sandbox_owner() {
    let (pool, windows, mut metering) = metering().await;
    let warm = json!({ "warmTemplateId": "sbxt_t" });
    created(
        &pool,
        json!({ "warmTemplateId": "sbxt_t", "ownerIdentityId": "reactor:sandboxes" }),
    )
    .await;
    let scheduled = append(&pool, "instance.scheduled", warm.clone()).await;
    after(scheduled.recorded_at + chrono::Duration::milliseconds(300)).await;
    let claim = append(
        &pool,
        "instance.starting",
        json!({ "sandboxId": "sbx_s", "ownerIdentityId": "id_bob",
                "claimedAt": vps_clock::Clock::system().now(), "desiredState": "running" }),
    )
    .await;
    after(claim.recorded_at + chrono::Duration::milliseconds(300)).await;
    let deleted = append(&pool, "instance.deleted", json!({ "sandboxId": "sbx_s" })).await;
    meter_past(&mut metering, &pool, deleted.recorded_at).await;

    let rows = records(&pool).await;
    let warm: Vec<&Row> = rows.iter().filter(|r| r.0 == "vps.sandbox.warm").collect();
    let owned: Vec<&Row> = rows.iter().filter(|r| r.0 == "vps.vcpu.hours").collect();
    assert_eq!(warm.first().unwrap().2, scheduled.recorded_at);
    assert_eq!(
        warm.last().unwrap().3,
        claim.recorded_at,
        "warm ends at the claim"
    );
    assert!(warm.iter().all(|r| r.1.is_none()), "warm has no identity");
    let warm_sum: Decimal = warm.iter().map(|r| r.4).sum();
    assert_eq!(warm_sum, hours(2, scheduled.recorded_at, claim.recorded_at));
    assert_eq!(
        owned.first().unwrap().2,
        claim.recorded_at,
        "the owner's from the claim"
    );
    assert_eq!(owned.last().unwrap().3, deleted.recorded_at);
    assert!(owned.iter().all(|r| r.1.as_deref() == Some("id_bob")));
    let owned_sum: Decimal = owned.iter().map(|r| r.4).sum();
    assert_eq!(owned_sum, hours(2, claim.recorded_at, deleted.recorded_at));
    let report = vps_reactors::usage::verify::verify(
        &pool,
        windows,
        DateTime::<Utc>::MIN_UTC,
        vps_clock::Clock::system().now(),
    )
    .await
    .unwrap();
    assert_eq!(report.first_difference, None);
    assert_eq!(report.compared, rows.len());
}

#[tokio::test]
async fn a_pass_does_not_read_back_the_records_it_appended() {
    let (pool, _, mut metering) = metering().await;
    created(&pool, json!({ "ownerIdentityId": "id_alice" })).await;
    let scheduled = append(&pool, "instance.scheduled", json!({})).await;
    meter_past(
        &mut metering,
        &pool,
        scheduled.recorded_at + chrono::Duration::milliseconds(500),
    )
    .await;
    assert!(!records(&pool).await.is_empty());
    // The log now holds the records after the instance's events; the next pass moves past
    // them without handing any to the ledger.
    let pass = metering.pass().await.unwrap();
    assert_eq!(pass.events, 0, "{pass:?}");
}

/// `(records in the log, records projected, the rollups' total, the records' total)`.
async fn totals(pool: &PgPool) -> (i64, i64, Decimal, Decimal) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM events WHERE type = 'usage.recorded'),
                (SELECT count(*) FROM usage_records),
                (SELECT coalesce(sum(daily), 0) FROM usage_rollups),
                (SELECT coalesce(sum(quantity), 0) FROM usage_records)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_worker_recording_windows_another_recorded_adds_nothing_to_the_log_or_the_views() {
    let (pool, windows, mut first) = metering().await;
    // Loaded now, so its mark stays behind the first worker's: like a second replica that
    // took over, or a restart after the log's commit and before the views'.
    let mut second = Metering::load(pool.clone(), &Notifier::local_only(), windows)
        .await
        .unwrap();
    created(&pool, json!({ "ownerIdentityId": "id_alice" })).await;
    let scheduled = append(&pool, "instance.scheduled", json!({})).await;
    after(scheduled.recorded_at + chrono::Duration::milliseconds(500)).await;
    let deleted = append(&pool, "instance.deleted", json!({})).await;
    meter_past(&mut first, &pool, deleted.recorded_at).await;
    let recorded = totals(&pool).await;
    assert!(recorded.0 >= 4, "{recorded:?}");
    assert_eq!(recorded.0, recorded.1, "every record is projected");
    assert_eq!(recorded.2, recorded.3, "the rollups add up the records");

    // The pipelined catch-up computes the same records again and finds them all stored.
    assert!(second.catch_up().await.unwrap() > 0);
    assert_eq!(totals(&pool).await, recorded);
}

#[tokio::test]
async fn a_catch_up_under_a_steady_stream_of_events_ends_after_a_short_page() {
    let (pool, _, mut metering) = metering().await;
    created(&pool, json!({})).await;
    // Four writers append events one after the other for five seconds (a margin for a slow
    // machine): every read of a pass finds new ones.
    let stop = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let stream = format!("instance-inst_{w}");
                while std::time::Instant::now() < stop {
                    let event = new_event(
                        "instance.scheduled",
                        json!({ "instanceId": format!("inst_{w}"), "tenantId": "acme" }),
                    );
                    let mut tx = pool.begin().await.unwrap();
                    vps_events::append(&mut tx, &stream, ExpectedVersion::Any, &[event])
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    // Passing on while the last pass found something would go on until the writers stop.
    let passes = metering.catch_up().await.unwrap();
    assert!(
        std::time::Instant::now() < stop,
        "the catch-up ran as long as the writers ({passes} passes)"
    );
    assert!(passes <= 2, "{passes} passes");
    for writer in writers {
        writer.await.unwrap();
    }
}

#[tokio::test]
async fn a_window_with_more_records_than_a_chunk_is_logged_and_projected_whole() {
    let pool = fresh_log().await;
    let windows = Windows::from_seconds(2.0).unwrap();
    let mut metering = Metering::load(pool.clone(), &Notifier::local_only(), windows)
        .await
        .unwrap();
    // 1,100 running instances of three tenants, two meters each: 2,200 records a window,
    // more than one append or projecting statement takes.
    const INSTANCES: usize = 1100;
    let mut tx = pool.begin().await.unwrap();
    for n in 0..INSTANCES {
        let data = instance_data(created_data(json!({
            "instanceId": format!("inst_{n}"), "tenantId": format!("t{}", n % 3),
            "idempotencyKey": format!("k{n}"), "state": "scheduling", "desiredState": "running",
            "ownerIdentityId": "id_alice" })));
        let events: Vec<NewEvent> = ["instance.created", "instance.scheduled"]
            .into_iter()
            .map(|event_type| new_event(event_type, data.clone()))
            .collect();
        let stream = format!("instance-inst_{n}");
        vps_events::append(&mut tx, &stream, ExpectedVersion::Any, &events)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let started: DateTime<Utc> = sqlx::query_scalar("SELECT max(recorded_at) FROM events")
        .fetch_one(&pool)
        .await
        .unwrap();
    let first_end = at(windows.start_of(micros(started)) + windows.length());
    meter_past(&mut metering, &pool, first_end).await;

    let (logged, projected, rollups, sum) = totals(&pool).await;
    assert_eq!(logged, projected, "every record is projected");
    assert_eq!(rollups, sum, "the rollups add up the records");
    let first: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM usage_records WHERE window_start = $1 AND window_end = $2",
    )
    .bind(started)
    .bind(first_end)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(first, 2 * INSTANCES as i64, "both meters of every instance");
    let report = vps_reactors::usage::verify::verify(&pool, windows, started, first_end)
        .await
        .unwrap();
    assert_eq!(report.first_difference, None);
}
