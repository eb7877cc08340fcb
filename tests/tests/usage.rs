//! Usage metering over HTTP: a real server (and a replica) on its own database with emulated
//! hosts, short windows, and the records read back through `usage.list`.

use std::str::FromStr;

use chrono::{DateTime, Duration, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use vps_tests::{eventually, wait_until, TestServer, ALICE, PATIENCE, SSH_KEY};

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
    t.ok(
        ALICE,
        "instances.delete",
        json!({ "tenantId": "acme", "instanceId": id }),
    )
    .await;
    let gone = t
        .until(ALICE, "acme", id, PATIENCE, |i| i["state"] == "deleted")
        .await;
    assert_eq!(gone["state"], "deleted");
}

/// When the instance's first event of `event_type` was recorded.
async fn recorded(t: &TestServer, id: &str, event_type: &str) -> DateTime<Utc> {
    let history = t
        .ok(
            ALICE,
            "instances.history",
            json!({ "tenantId": "acme", "instanceId": id }),
        )
        .await;
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
        Utc::now() >= ran_long_enough
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
