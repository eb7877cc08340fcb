//! Usage metering over HTTP: a real server (and a replica) on its own database with emulated
//! hosts, short windows, and the records read back through `usage.list`.

use std::str::FromStr;

use chrono::{DateTime, Duration, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use vps_tests::{acme_instance, eventually, wait_until, TestServer, ALICE, PATIENCE, SSH_KEY};

/// A server whose metering windows are `window` seconds long.
async fn server(window: f64) -> TestServer {
    TestServer::start_with(|c| c.timings.usage_window = window).await
}

/// A hosted pool offered to `acme` with one emulated host; the pool id and the host.
async fn pool_with_host(t: &TestServer) -> (String, vps_emulators::host::HostHandle) {
    let pool = t
        .hosted_pool(
            "10.9.0.0/24",
            0,
            json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": 2000 }),
        )
        .await;
    let (node, token) = t.register_node(&pool, "host-0").await;
    let host = t.host(&node, &token, std::time::Duration::from_millis(20));
    (pool, host)
}

async fn create(t: &TestServer, pool: &str, key: &str) -> String {
    let inst = t
        .ok(
            ALICE,
            "instances.create",
            json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu",
                    "sshKeys": [SSH_KEY], "idempotencyKey": key }),
        )
        .await;
    let id = inst["id"].as_str().unwrap().to_string();
    let running = t
        .until(ALICE, "acme", &id, PATIENCE, |i| i["state"] == "running")
        .await;
    assert_eq!(running["state"], "running");
    id
}

async fn delete(t: &TestServer, id: &str) {
    t.ok(ALICE, "instances.delete", acme_instance(id)).await;
    let gone = t
        .until(ALICE, "acme", id, PATIENCE, |i| i["state"] == "deleted")
        .await;
    assert_eq!(gone["state"], "deleted");
}

/// When the instance's first event of `event_type` was recorded.
async fn recorded(t: &TestServer, id: &str, event_type: &str) -> DateTime<Utc> {
    let history = t.ok(ALICE, "instances.history", acme_instance(id)).await;
    let event = history["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == event_type)
        .unwrap_or_else(|| panic!("{id} has no {event_type}"));
    event["time"].as_str().unwrap().parse().unwrap()
}

/// Waits until the metering reactor has recorded every window that ends by `time`.
async fn settled_past(t: &TestServer, time: DateTime<Utc>) {
    eventually("usage settled past the time", PATIENCE, || async {
        let until: Option<DateTime<Utc>> =
            sqlx::query_scalar("SELECT settled_until FROM usage_progress")
                .fetch_optional(&t.server.state.pool)
                .await
                .unwrap();
        match until {
            Some(u) if u >= time => Ok(()),
            other => Err(format!("settled until {other:?}")),
        }
    })
    .await;
}

/// Every record of `resource` on `meter` through `usage.list`, page by page, in window order.
async fn records(t: &TestServer, token: &str, resource: &str, meter: &str) -> Vec<Value> {
    let mut items = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "tenantId": "acme", "from": "2000-01-01T00:00:00Z",
                               "to": "2100-01-01T00:00:00Z", "resourceId": resource,
                               "meter": meter, "limit": 3 });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let page = t.ok(token, "usage.list", body).await;
        items.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return items,
        }
    }
}

fn time(v: &Value) -> DateTime<Utc> {
    v.as_str().unwrap().parse().unwrap()
}

fn quantity(record: &Value) -> Decimal {
    Decimal::from_str(record["quantity"].as_str().unwrap()).unwrap()
}

/// `rate` units for the span in unit-hours, rounded once to the records' 12 places.
fn exact(rate: i64, from: DateTime<Utc>, to: DateTime<Utc>) -> Decimal {
    let micros = (to - from).num_microseconds().unwrap();
    (Decimal::from(rate * micros) / Decimal::from(3_600_000_000i64)).round_dp(12)
}

/// The records cover `[from, to)` end to end: no gap, no overlap, nothing outside.
fn assert_contiguous(records: &[Value], from: DateTime<Utc>, to: DateTime<Utc>) {
    assert!(!records.is_empty());
    assert_eq!(time(&records[0]["windowStart"]), from, "{records:#?}");
    for pair in records.windows(2) {
        assert_eq!(
            time(&pair[0]["windowEnd"]),
            time(&pair[1]["windowStart"]),
            "a gap or an overlap: {pair:#?}"
        );
    }
    assert_eq!(
        time(&records.last().unwrap()["windowEnd"]),
        to,
        "{records:#?}"
    );
}

#[tokio::test]
async fn an_instance_running_three_and_a_half_windows_is_billed_exactly_to_the_last_digit() {
    let window = 1.0;
    let t = server(window).await;
    let (pool, _host) = pool_with_host(&t).await;
    let id = create(&t, &pool, "exact").await;
    let scheduled = recorded(&t, &id, "instance.scheduled").await;
    let ran_long_enough = scheduled + Duration::milliseconds(3500);
    wait_until("three and a half windows", PATIENCE, || async {
        vps_clock::Clock::system().now() >= ran_long_enough
    })
    .await;
    delete(&t, &id).await;
    let deleted = recorded(&t, &id, "instance.deleted").await;
    settled_past(&t, deleted + Duration::seconds(1)).await;

    let vcpu = records(&t, ALICE, &id, "vps.vcpu.hours").await;
    assert!(vcpu.len() >= 4, "3.5 windows touch at least 4: {vcpu:#?}");
    assert_contiguous(&vcpu, scheduled, deleted);
    let sum: Decimal = vcpu.iter().map(quantity).sum();
    assert_eq!(sum, exact(2, scheduled, deleted), "small is 2 vCPUs");
    assert!(vcpu.iter().all(|r| r["identityId"] == "id_alice"));
    assert!(vcpu.iter().all(|r| r["unit"] == "vcpu-hour"));
    let memory = records(&t, ALICE, &id, "vps.memory.gib.hours").await;
    let sum: Decimal = memory.iter().map(quantity).sum();
    assert_eq!(sum, exact(4, scheduled, deleted), "small has 4 GiB");
    // Windows are aligned to the epoch: every inner boundary is a whole second.
    for r in &vcpu[1..] {
        assert_eq!(time(&r["windowStart"]).timestamp_subsec_micros(), 0);
    }
    assert!(t.replay_equal().await);
}

/// The server's metering windows.
fn windows(t: &TestServer) -> vps_domain::usage::Windows {
    vps_api::server::usage_windows(&t.server.state.config)
}

async fn verify(t: &TestServer) -> vps_reactors::usage::verify::VerifyReport {
    let (from, to) = (
        DateTime::<Utc>::MIN_UTC,
        vps_clock::Clock::system().now() + Duration::days(1),
    );
    vps_reactors::usage::verify::verify(&t.server.state.pool, windows(t), from, to)
        .await
        .expect("verify runs")
}

#[tokio::test]
async fn two_replicas_record_every_window_once_and_verify_finds_an_inserted_record() {
    let t = server(0.5).await;
    let replica = t.replica().await;
    let (pool, _host) = pool_with_host(&t).await;
    let mut ids = Vec::new();
    for n in 0..4 {
        ids.push(create(&t, &pool, &format!("churn-{n}")).await);
    }
    // Churn: one resized while stopped, two deleted, one left running.
    t.ok(ALICE, "instances.stop", acme_instance(&ids[0])).await;
    t.until(ALICE, "acme", &ids[0], PATIENCE, |i| {
        i["state"] == "stopped"
    })
    .await;
    t.ok(
        ALICE,
        "instances.resize",
        json!({ "tenantId": "acme", "instanceId": ids[0], "flavor": "large" }),
    )
    .await;
    for id in &ids[1..3] {
        delete(&t, id).await;
    }
    let last = recorded(&t, &ids[2], "instance.deleted").await;
    settled_past(&t, last + Duration::seconds(1)).await;

    for id in &ids[1..3] {
        let vcpu = records(&t, ALICE, id, "vps.vcpu.hours").await;
        let (scheduled, deleted) = (
            recorded(&t, id, "instance.scheduled").await,
            recorded(&t, id, "instance.deleted").await,
        );
        assert_contiguous(&vcpu, scheduled, deleted);
        let sum: Decimal = vcpu.iter().map(quantity).sum();
        assert_eq!(sum, exact(2, scheduled, deleted));
    }
    // The resized one: 2 vCPUs until the resize, 8 after, the window cut at the change.
    let resized = recorded(&t, &ids[0], "instance.resized").await;
    let vcpu = records(&t, ALICE, &ids[0], "vps.vcpu.hours").await;
    let before = vcpu.iter().filter(|r| time(&r["windowEnd"]) <= resized);
    assert!(before.clone().count() > 0);
    assert!(vcpu.iter().any(|r| time(&r["windowStart"]) == resized));
    let rates_ok = vcpu.iter().all(|r| {
        let span = time(&r["windowEnd"]) - time(&r["windowStart"]);
        let rate = if time(&r["windowStart"]) < resized {
            2
        } else {
            8
        };
        (quantity(r)
            - exact(
                rate,
                time(&r["windowStart"]),
                time(&r["windowStart"]) + span,
            ))
        .abs()
            <= Decimal::new(1, 12)
    });
    assert!(rates_ok, "{vcpu:#?}");

    let report = verify(&t).await;
    assert_eq!(report.first_difference, None);
    assert!(report.compared > 0);
    assert!(vps_api::tools::usage::verify(
        &t.server.state.pool,
        windows(&t),
        DateTime::<Utc>::MIN_UTC,
        vps_clock::Clock::system().now()
    )
    .await
    .unwrap());
    assert!(t.replay_equal().await);

    // Tamper: an extra usage.recorded event, inserted behind the reactor's back.
    let sample: Value = sqlx::query_scalar(
        "SELECT data FROM events WHERE type = 'usage.recorded' ORDER BY position LIMIT 1",
    )
    .fetch_one(&t.server.state.pool)
    .await
    .unwrap();
    let mut forged = sample.clone();
    forged["quantity"] = json!("1");
    sqlx::query(
        "INSERT INTO events (stream, version, id, type, data, metadata)
         VALUES ('tenant-acme', 1000000, 'evt_forged', 'usage.recorded', $1, '{}')",
    )
    .bind(&forged)
    .execute(&t.server.state.pool)
    .await
    .unwrap();
    let report = verify(&t).await;
    match report.first_difference {
        Some(vps_reactors::usage::verify::Difference::Extra(id, _)) => assert_eq!(id, "evt_forged"),
        other => panic!("expected the forged record, got {other:?}"),
    }
    replica.shutdown().await;
}

#[tokio::test]
async fn a_server_stopped_mid_window_and_restarted_misses_and_doubles_no_window() {
    let t = server(0.5).await;
    let (pool, _host) = pool_with_host(&t).await;
    let id = create(&t, &pool, "restart").await;
    let scheduled = recorded(&t, &id, "instance.scheduled").await;
    settled_past(&t, scheduled + Duration::seconds(1)).await;
    // Stop every background part wherever it is (a metering pass may be mid-transaction):
    // nothing it had not committed survives, as after kill -9.
    let vps_tests::TestServer {
        server,
        http,
        snapshots,
        clock,
    } = t;
    let mut config = (*server.state.config).clone();
    let db = server.state.pool.clone();
    server.shutdown().await;
    // A killed process's sessions end with it, and with them any transaction one held open
    // (an aborted pass's, which holds back the read horizon: `time_horizon` takes the oldest
    // `xact_start`). End them until none of this database is in a transaction, and give the
    // new process its own sessions.
    let options = (*db.connect_options()).clone();
    let killer = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
        .unwrap();
    wait_until("no old session in a transaction", PATIENCE, || async {
        let ended: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()
                AND xact_start IS NOT NULL",
        )
        .fetch_all(&killer)
        .await
        .unwrap();
        ended.is_empty()
    })
    .await;
    killer.close().await;
    db.close().await;
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect_with(options)
        .await
        .unwrap();
    let down_until = vps_clock::Clock::system().now() + Duration::seconds(2);
    wait_until("windows closed while down", PATIENCE, || async {
        vps_clock::Clock::system().now() >= down_until
    })
    .await;
    config.http.listen = "127.0.0.1:0".into();
    let server = vps_api::server::start_with_clock(config, db, clock.clock())
        .await
        .expect("restarts");
    let t = TestServer {
        server,
        http,
        snapshots,
        clock,
    };
    settled_past(&t, down_until + Duration::seconds(1)).await;
    let until: DateTime<Utc> = sqlx::query_scalar("SELECT settled_until FROM usage_progress")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
    let vcpu = records(&t, ALICE, &id, "vps.vcpu.hours").await;
    let settled: Vec<Value> = vcpu
        .into_iter()
        .filter(|r| time(&r["windowEnd"]) <= until)
        .collect();
    assert_contiguous(&settled, scheduled, until);
    let sum: Decimal = settled.iter().map(quantity).sum();
    assert_eq!(sum, exact(2, scheduled, until));
    assert_eq!(verify(&t).await.first_difference, None);
}

#[tokio::test]
async fn usage_list_refuses_bad_ranges_and_other_tenants_with_client_errors() {
    let t = server(300.0).await;
    let list = |body: Value| t.call(ALICE, "usage.list", body);
    let range = |from: &str, to: &str| json!({ "tenantId": "acme", "from": from, "to": to });
    for body in [
        range("2026-01-02T00:00:00Z", "2026-01-01T00:00:00Z"),
        range("+100000-01-01T00:00:00Z", "+100001-01-01T00:00:00Z"),
        range("yesterday", "2026-01-01T00:00:00Z"),
        json!({ "tenantId": "acme", "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z", "cursor": "x" }),
        json!({ "tenantId": "acme", "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z", "limit": 0 }),
    ] {
        let answer = list(body.clone()).await.expect_err("refused");
        assert_eq!(
            (answer.status, &answer.body["code"]),
            (400, &json!("INVALID_INPUT")),
            "{body}"
        );
    }
    let other = json!({ "tenantId": "globex", "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z" });
    let other = list(other).await.expect_err("another tenant");
    assert_eq!(other.status, 404);
    let mine = list(json!({ "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z" }))
        .await
        .expect("a tenant's own, by default");
    assert_eq!(mine["items"], json!([]));
}

#[tokio::test]
async fn a_webhook_subscribed_to_usage_receives_the_usage_records() {
    use std::sync::{Arc, Mutex};
    let t = server(0.5).await;
    let bodies: Arc<Mutex<Vec<Value>>> = Arc::default();
    let sink = bodies.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |body: String| {
            let sink = sink.clone();
            async move {
                sink.lock()
                    .unwrap()
                    .push(serde_json::from_str(&body).unwrap());
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    t.ok(
        ALICE,
        "webhooks.create",
        json!({ "url": url, "types": ["usage.*"] }),
    )
    .await;

    let (pool, _host) = pool_with_host(&t).await;
    let id = create(&t, &pool, "hooked").await;
    wait_until("usage records delivered", PATIENCE, || async {
        bodies.lock().unwrap().len() >= 2
    })
    .await;
    let got = bodies.lock().unwrap().clone();
    for event in &got {
        assert_eq!(event["type"], "usage.recorded", "{event}");
        assert_eq!(event["subject"], "tenant/acme");
        assert_eq!(event["tenantid"], "acme");
        assert_eq!(event["data"]["resourceId"], json!(id));
        assert!(event["data"]["quantity"].is_string());
    }
}

#[tokio::test]
async fn an_errored_instance_stops_accruing_at_the_event_that_made_it_errored() {
    let window = 1.0;
    let t = server(window).await;
    let (pool, host) = pool_with_host(&t).await;
    let id = create(&t, &pool, "errored").await;
    let scheduled = recorded(&t, &id, "instance.scheduled").await;
    host.fail_instance(&id, "the guest crashed");
    let errored = t
        .until(ALICE, "acme", &id, PATIENCE, |i| i["state"] == "error")
        .await;
    assert_eq!(errored["state"], "error");
    let failed = recorded(&t, &id, "instance.failed").await;
    // Two more windows in error, still holding its place on the host: none of them billed.
    let later = failed + Duration::seconds(2);
    wait_until("two windows in error", PATIENCE, || async {
        vps_clock::Clock::system().now() >= later
    })
    .await;
    settled_past(&t, later).await;

    for (meter, rate) in [("vps.vcpu.hours", 2), ("vps.memory.gib.hours", 4)] {
        let billed = records(&t, ALICE, &id, meter).await;
        assert_contiguous(&billed, scheduled, failed);
        let sum: Decimal = billed.iter().map(quantity).sum();
        assert_eq!(sum, exact(rate, scheduled, failed), "{meter}: {billed:#?}");
    }
    assert!(verify(&t).await.first_difference.is_none());
    assert!(t.replay_equal().await);
}
