//! Lifecycle additions (SPEC §3.12) over HTTP against a real server, its reconcilers and
//! emulated hosts: pause and resume, the paused TTL, `onTimeout: pause`, `autoResume`, and
//! what a paused sandbox is billed.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use vps_tests::{
    acme_instance, acme_sandbox, eventually, merged, quota, TestServer, ALICE, EVE, OPERATOR,
    PATIENCE, SSH_KEY,
};

const BOOT: Duration = Duration::from_millis(50);

async fn server() -> TestServer {
    TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.sandbox_expiring_lead = 1.0;
        c.timings.sandbox_expiring_min_lead = 0.2;
        c.timings.usage_window = 0.5;
    })
    .await
}

async fn pool_with_host(t: &TestServer) -> (String, Vec<vps_emulators::host::HostHandle>) {
    t.pool_with_hosts("10.0.0.0/22", quota(1000), 1, BOOT).await
}

async fn template(t: &TestServer, pool: &str, name: &str, extra: Value) -> String {
    let tpl = t.sandbox_template(pool, name, extra).await;
    tpl["id"].as_str().unwrap().to_string()
}

async fn create(t: &TestServer, template: &str, key: &str, extra: Value) -> Value {
    t.ready_sandbox(template, key, extra).await
}

fn call(id: &str) -> Value {
    acme_sandbox(id)
}

async fn sandbox(t: &TestServer, id: &str) -> Value {
    t.ok(ALICE, "sandboxes.get", call(id)).await
}

async fn instance(t: &TestServer, id: &str) -> Value {
    t.ok(OPERATOR, "instances.get", acme_instance(id)).await
}

/// Waits until the sandbox is in `state`.
async fn reaches(t: &TestServer, id: &str, state: &str) -> Value {
    eventually(&format!("sandbox {id} {state}"), PATIENCE, || async {
        let now = sandbox(t, id).await;
        if now["state"] == state {
            Ok(now)
        } else {
            Err(now["state"].clone())
        }
    })
    .await
}

/// The types of the sandbox's own events, oldest first.
async fn sandbox_events(t: &TestServer, id: &str) -> Vec<Value> {
    t.settle().await;
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.*"], "subject": format!("sandbox/{id}") }),
        )
        .await;
    events["items"].as_array().unwrap().clone()
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

fn time(v: &Value) -> DateTime<Utc> {
    v.as_str().unwrap().parse().unwrap()
}

fn refusal(answer: Result<Value, vps_tests::Answer>) -> Value {
    answer.expect_err("a refusal").body
}

#[tokio::test]
async fn pause_keeps_the_instance_paused_stops_the_clock_and_resume_brings_it_back() {
    let t = server().await;
    let (pool, _hosts) = pool_with_host(&t).await;
    let tpl = template(&t, &pool, "p", json!({ "pausedTtlSeconds": 3600 })).await;
    let s = create(&t, &tpl, "p", json!({ "ttlSeconds": 60 })).await;
    let id = s["id"].as_str().unwrap();
    let inst_id = s["instanceId"].as_str().unwrap();

    let pausing = t.ok(ALICE, "sandboxes.pause", call(id)).await;
    assert!(
        ["pausing", "paused"].contains(&pausing["state"].as_str().unwrap()),
        "{pausing}"
    );
    let paused = reaches(&t, id, "paused").await;
    // The clock stopped: the sandbox now ends with its paused TTL, an hour away.
    let ends = time(&paused["expiresAt"]) - time(&paused["pausedAt"]);
    assert!((ends.num_seconds() - 3600).abs() <= 1, "{paused}");
    let inst = instance(&t, inst_id).await;
    assert_eq!(
        (inst["state"].as_str(), inst["desiredState"].as_str()),
        (Some("paused"), Some("paused"))
    );
    // Idempotent: a second pause changes nothing.
    let again = t.ok(ALICE, "sandboxes.pause", call(id)).await;
    assert_eq!(again["version"], paused["version"]);

    // Exec and snapshot refuse a paused sandbox, naming its state.
    let exec = t
        .call(
            ALICE,
            "sandboxes.exec",
            json!({ "tenantId": "acme", "sandboxId": id, "publicKey": SSH_KEY }),
        )
        .await;
    let body = refusal(exec);
    assert_eq!(
        (body["code"].as_str(), body["details"]["state"].as_str()),
        (Some("INVALID_STATE"), Some("paused")),
        "{body}"
    );
    let snap = refusal(t.call(ALICE, "sandboxes.snapshot", call(id)).await);
    assert_eq!(
        (snap["code"].as_str(), snap["details"]["state"].as_str()),
        (Some("INVALID_STATE"), Some("paused")),
        "{snap}"
    );
    // An extend waits for a resume too.
    let extend = refusal(
        t.call(
            ALICE,
            "sandboxes.extend",
            json!({ "tenantId": "acme", "sandboxId": id, "by": "1h" }),
        )
        .await,
    );
    assert_eq!(extend["code"], "INVALID_STATE");

    let mut resume = call(id);
    resume["ttlSeconds"] = json!(120);
    let resuming = t.ok(ALICE, "sandboxes.resume", resume.clone()).await;
    assert!(
        ["resuming", "ready"].contains(&resuming["state"].as_str().unwrap()),
        "{resuming}"
    );
    let ready = reaches(&t, id, "ready").await;
    assert!(ready.get("pausedAt").is_none(), "{ready}");
    let lifetime = time(&ready["expiresAt"]) - t.clock.now();
    assert!(
        lifetime.num_seconds() > 100 && lifetime.num_seconds() <= 120,
        "a fresh lifetime of 120 s: {ready}"
    );
    let again = t.ok(ALICE, "sandboxes.resume", resume).await;
    assert_eq!(again["version"], ready["version"], "idempotent");
    let inst = instance(&t, inst_id).await;
    assert_eq!(
        (inst["state"].as_str(), inst["desiredState"].as_str()),
        (Some("running"), Some("running"))
    );

    let events = sandbox_events(&t, id).await;
    assert_eq!(
        types(&events),
        [
            "sandbox.created",
            "sandbox.ready",
            "sandbox.pausing",
            "sandbox.paused",
            "sandbox.resuming",
            "sandbox.resumed"
        ]
    );
    assert!(events[3]["data"]["templateId"] == tpl.as_str());
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_paused_sandbox_is_deleted_when_its_paused_ttl_runs_out() {
    let t = server().await;
    let (pool, _hosts) = pool_with_host(&t).await;
    let tpl = template(&t, &pool, "short", json!({ "pausedTtlSeconds": 60 })).await;
    let s = create(&t, &tpl, "short", json!({ "ttlSeconds": 3600 })).await;
    let id = s["id"].as_str().unwrap();
    t.ok(ALICE, "sandboxes.pause", call(id)).await;
    reaches(&t, id, "paused").await;
    t.advance(Duration::from_secs(61));
    let gone = reaches(&t, id, "deleted").await;
    assert_eq!(
        (gone["expired"].as_bool(), gone["reason"].as_str()),
        (Some(true), Some("paused-ttl")),
        "{gone}"
    );
    let events = sandbox_events(&t, id).await;
    let expired = events
        .iter()
        .find(|e| e["type"] == "sandbox.expired")
        .expect("sandbox.expired");
    assert_eq!(expired["data"]["reason"], "paused-ttl");
    assert_eq!(expired["data"]["action"], "deleted");
    let deleted = events.last().unwrap();
    assert_eq!(
        (deleted["type"].as_str(), deleted["data"]["reason"].as_str()),
        (Some("sandbox.deleted"), Some("paused-ttl"))
    );
    // A deleted sandbox cannot be resumed.
    let resume = refusal(t.call(ALICE, "sandboxes.resume", call(id)).await);
    assert_eq!(resume["code"], "INVALID_STATE");
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn on_timeout_pause_pauses_at_expiry_and_resume_brings_it_back() {
    let t = server().await;
    let (pool, _hosts) = pool_with_host(&t).await;
    let tpl = template(&t, &pool, "keep", json!({})).await;
    let s = create(
        &t,
        &tpl,
        "keep",
        json!({ "ttlSeconds": 2, "onTimeout": "pause" }),
    )
    .await;
    assert_eq!(s["onTimeout"], "pause");
    let id = s["id"].as_str().unwrap();
    // Real time, not a moved clock: `pausedAt` is the log's (the database's) time and
    // `expiresAt` the server's clock, and the test compares the two.
    let paused = reaches(&t, id, "paused").await;
    assert_eq!(paused["expired"], false, "{paused}");
    // The paused TTL defaults to 7 days.
    let ends = time(&paused["expiresAt"]) - time(&paused["pausedAt"]);
    assert!((ends.num_seconds() - 7 * 86_400).abs() <= 1, "{paused}");
    let events = sandbox_events(&t, id).await;
    let expired = events
        .iter()
        .find(|e| e["type"] == "sandbox.expired")
        .expect("sandbox.expired");
    assert_eq!(expired["data"]["action"], "paused", "{expired}");
    t.ok(ALICE, "sandboxes.resume", call(id)).await;
    let ready = reaches(&t, id, "ready").await;
    // The template's default lifetime (3600 s) starts again at the resume.
    let lifetime = time(&ready["expiresAt"]) - t.clock.now();
    assert!(lifetime.num_seconds() > 3500, "{ready}");
    // And a template can make pause the default.
    let tpl2 = template(&t, &pool, "keep2", json!({ "onTimeout": "pause" })).await;
    let s2 = create(&t, &tpl2, "keep2", json!({ "ttlSeconds": 60 })).await;
    assert_eq!(s2["onTimeout"], "pause");
    t.advance(Duration::from_secs(61));
    reaches(&t, s2["id"].as_str().unwrap(), "paused").await;
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn auto_resume_resumes_a_paused_sandbox_before_a_snapshot_and_an_exec() {
    let t = server().await;
    let (pool, _hosts) = pool_with_host(&t).await;
    let tpl = template(&t, &pool, "auto", json!({ "autoResume": true })).await;
    let s = create(&t, &tpl, "auto", json!({})).await;
    let id = s["id"].as_str().unwrap();
    t.ok(ALICE, "sandboxes.pause", call(id)).await;
    reaches(&t, id, "paused").await;
    let mut body = call(id);
    body["wait"] = json!({ "timeoutMs": 20000 });
    let snap = t.ok(ALICE, "sandboxes.snapshot", body).await;
    assert_eq!(snap["sandboxId"], id);
    assert_eq!(sandbox(&t, id).await["state"], "ready");

    t.ok(ALICE, "sandboxes.pause", call(id)).await;
    reaches(&t, id, "paused").await;
    let exec = t
        .ok(
            ALICE,
            "sandboxes.exec",
            json!({ "tenantId": "acme", "sandboxId": id, "publicKey": SSH_KEY,
                    "wait": { "timeoutMs": 20000 } }),
        )
        .await;
    assert!(exec["certificate"].as_str().is_some(), "{exec}");
    assert_eq!(sandbox(&t, id).await["state"], "ready");
}

#[tokio::test]
async fn pause_and_resume_refuse_what_they_cannot_do() {
    let t = server().await;
    let (pool, _hosts) = pool_with_host(&t).await;
    let tpl = template(&t, &pool, "bad", json!({})).await;
    let s = create(&t, &tpl, "bad", json!({})).await;
    let id = s["id"].as_str().unwrap();
    // Another tenant's sandbox does not exist for it.
    for method in ["sandboxes.pause", "sandboxes.resume"] {
        let body = json!({ "tenantId": "globex", "sandboxId": id });
        assert_eq!(
            refusal(t.call(EVE, method, body).await)["code"],
            "NOT_FOUND"
        );
    }
    // Bounds, each naming its field.
    let mut resume = call(id);
    resume["ttlSeconds"] = json!(0);
    t.ok(ALICE, "sandboxes.pause", call(id)).await;
    let body = refusal(t.call(ALICE, "sandboxes.resume", resume).await);
    assert_eq!(
        (body["code"].as_str(), body["details"]["field"].as_str()),
        (Some("INVALID_INPUT"), Some("ttlSeconds")),
        "{body}"
    );
    for (extra, field) in [
        (json!({ "pausedTtlSeconds": 0 }), "pausedTtlSeconds"),
        (
            json!({ "pausedTtlSeconds": 31 * 86_400 }),
            "pausedTtlSeconds",
        ),
        (json!({ "onTimeout": "explode" }), "onTimeout"),
    ] {
        let body = json!({ "tenantId": "acme", "name": "x", "poolId": pool,
                           "flavor": "small", "imageId": "img_ubuntu" });
        let body = merged(body, extra);
        let answer = refusal(t.call(ALICE, "sandboxTemplates.create", body).await);
        assert_eq!(answer["code"], "INVALID_INPUT", "{answer}");
        assert!(answer.to_string().contains(field), "{answer} names {field}");
    }
    let bad = json!({ "tenantId": "acme", "templateId": tpl, "idempotencyKey": "bad2",
                      "onTimeout": "later" });
    let answer = refusal(t.call(ALICE, "sandboxes.create", bad).await);
    assert_eq!(
        (answer["code"].as_str(), answer["details"]["field"].as_str()),
        (Some("INVALID_INPUT"), Some("onTimeout")),
        "{answer}"
    );

    // A runtime that cannot pause: UNSUPPORTED, and onTimeout pause is refused up front.
    let pool = t
        .ok(
            OPERATOR,
            "pools.create",
            json!({ "name": "ctr", "class": "vps-host", "runtime": "containerd" }),
        )
        .await;
    let pool = pool["id"].as_str().unwrap();
    t.ok(
        OPERATOR,
        "pools.setIpPool",
        json!({ "poolId": pool, "cidr": "10.8.0.0/24" }),
    )
    .await;
    t.ok(
        OPERATOR,
        "pools.offer",
        json!({ "poolId": pool, "tenantId": "acme", "quota": { "vcpu": 10, "memoryGiB": 100, "diskGiB": 100 } }),
    )
    .await;
    t.ok(
        OPERATOR,
        "flavors.create",
        json!({ "poolId": pool, "name": "small", "vcpu": 1, "memoryGiB": 1, "diskGiB": 10 }),
    )
    .await;
    let refused = json!({ "tenantId": "acme", "name": "ctr-pause", "poolId": pool,
                          "flavor": "small", "imageId": "img_ubuntu", "onTimeout": "pause" });
    let answer = refusal(t.call(ALICE, "sandboxTemplates.create", refused).await);
    assert_eq!(
        (answer["code"].as_str(), answer["details"]["field"].as_str()),
        (Some("INVALID_INPUT"), Some("onTimeout"))
    );
    let ctr = template(&t, pool, "ctr", json!({})).await;
    let s = t
        .ok(
            ALICE,
            "sandboxes.create",
            json!({ "tenantId": "acme", "templateId": ctr, "idempotencyKey": "ctr" }),
        )
        .await;
    let answer = refusal(
        t.call(ALICE, "sandboxes.pause", call(s["id"].as_str().unwrap()))
            .await,
    );
    assert_eq!(answer["code"], "UNSUPPORTED", "{answer}");
}

fn quantity(record: &Value) -> Decimal {
    Decimal::from_str(record["quantity"].as_str().unwrap()).unwrap()
}

async fn records(t: &TestServer, resource: &str, meter: &str) -> Vec<Value> {
    let page = t
        .ok(
            ALICE,
            "usage.list",
            json!({ "tenantId": "acme", "from": "2000-01-01T00:00:00Z",
                    "to": "2100-01-01T00:00:00Z", "resourceId": resource, "meter": meter,
                    "limit": 1000 }),
        )
        .await;
    page["items"].as_array().unwrap().clone()
}

/// When the instance's last event of `event_type` was recorded.
async fn recorded(t: &TestServer, id: &str, event_type: &str) -> DateTime<Utc> {
    let history = t.ok(ALICE, "instances.history", acme_instance(id)).await;
    let event = history["items"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|e| e["type"] == event_type)
        .unwrap_or_else(|| panic!("{id} has no {event_type}"));
    time(&event["time"])
}

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

#[tokio::test]
async fn a_paused_sandbox_is_billed_the_memory_it_holds_and_usage_verify_agrees() {
    let t = server().await;
    let (pool, _hosts) = pool_with_host(&t).await;
    let tpl = template(&t, &pool, "bill", json!({})).await;
    let s = create(&t, &tpl, "bill", json!({})).await;
    let (id, inst) = (s["id"].as_str().unwrap(), s["instanceId"].as_str().unwrap());
    t.ok(ALICE, "sandboxes.pause", call(id)).await;
    reaches(&t, id, "paused").await;
    t.ok(ALICE, "sandboxes.resume", call(id)).await;
    reaches(&t, id, "ready").await;
    let paused_at = recorded(&t, inst, "instance.paused").await;
    let ran_again = recorded(&t, inst, "instance.running").await;
    settled_past(&t, ran_again + chrono::Duration::seconds(1)).await;

    let paused = records(&t, inst, "vps.sandbox.paused.gib.hours").await;
    assert!(!paused.is_empty());
    let sum: Decimal = paused.iter().map(quantity).sum();
    // `small` holds 4 GiB: 4 GiB·hours per hour paused, exactly from pause to run.
    let micros = (ran_again - paused_at).num_microseconds().unwrap();
    let exact = (Decimal::from(4 * micros) / Decimal::from(3_600_000_000i64)).round_dp(12);
    assert_eq!(sum, exact, "{paused:#?}");
    assert!(paused.iter().all(|r| r["unit"] == "gib-hour"));
    // No vCPU hours accrue inside the pause.
    let vcpu = records(&t, inst, "vps.vcpu.hours").await;
    assert!(
        vcpu.iter()
            .all(|r| time(&r["windowEnd"]) <= paused_at || time(&r["windowStart"]) >= ran_again),
        "{vcpu:#?}"
    );
    let windows = vps_api::server::usage_windows(&t.server.state.config);
    let report = vps_reactors::usage::verify::verify(
        &t.server.state.pool,
        windows,
        DateTime::<Utc>::MIN_UTC,
        vps_clock::Clock::system().now() + chrono::Duration::days(1),
    )
    .await
    .expect("verify runs");
    assert_eq!(report.first_difference, None);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn labels_on_sandboxes_and_templates_are_set_listed_filtered_and_announced() {
    let t = server().await;
    let (pool, _hosts) = pool_with_host(&t).await;
    let tpl = template(&t, &pool, "lab", json!({ "labels": { "team": "ml" } })).await;
    template(&t, &pool, "other", json!({ "labels": { "team": "web" } })).await;
    let listed = t
        .ok(
            ALICE,
            "sandboxTemplates.list",
            json!({ "tenantId": "acme", "labels": { "team": "ml" } }),
        )
        .await;
    let names: Vec<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["lab"]);
    let relabeled = t
        .ok(
            ALICE,
            "sandboxTemplates.setLabels",
            json!({ "tenantId": "acme", "templateId": tpl, "labels": { "team": "infra" } }),
        )
        .await;
    assert_eq!(relabeled["labels"], json!({ "team": "infra" }));

    let a = create(
        &t,
        &tpl,
        "a",
        json!({ "labels": { "team": "ml", "app.example.com/tier": "gpu" } }),
    )
    .await;
    let b = create(&t, &tpl, "b", json!({ "labels": { "team": "web" } })).await;
    assert_eq!(a["labels"]["team"], "ml");
    let filter = |labels: Value| {
        t.ok(
            ALICE,
            "sandboxes.list",
            json!({ "tenantId": "acme", "labels": labels }),
        )
    };
    let ids = |page: Value| -> Vec<String> {
        page["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        ids(filter(json!({ "team": "ml" })).await),
        [a["id"].as_str().unwrap()]
    );
    assert!(ids(filter(json!({ "team": "ml", "app.example.com/tier": "cpu" })).await).is_empty());
    assert_eq!(ids(filter(json!({})).await).len(), 2);

    // setLabels replaces them, and the change is an event.
    let b_id = b["id"].as_str().unwrap();
    let body = json!({ "tenantId": "acme", "sandboxId": b_id, "labels": { "team": "ml" } });
    let b2 = t.ok(ALICE, "sandboxes.setLabels", body.clone()).await;
    assert_eq!(b2["labels"], json!({ "team": "ml" }));
    let again = t.ok(ALICE, "sandboxes.setLabels", body).await;
    assert_eq!(
        again["version"], b2["version"],
        "the same labels change nothing"
    );
    assert_eq!(
        filter(json!({ "team": "ml" })).await["items"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let events = sandbox_events(&t, b_id).await;
    let labeled = events.last().unwrap();
    assert_eq!(labeled["type"], "sandbox.labeled");
    assert_eq!(labeled["data"]["labels"], json!({ "team": "ml" }));

    // Bad labels name the key; more than 32 (labels or filter pairs) are refused.
    for labels in [json!({ "-bad": "x" }), json!({ "team": "has space" })] {
        let body = json!({ "tenantId": "acme", "sandboxId": b_id, "labels": labels });
        let answer = refusal(t.call(ALICE, "sandboxes.setLabels", body).await);
        assert_eq!(answer["code"], "INVALID_INPUT", "{answer}");
        let key = labels.as_object().unwrap().keys().next().unwrap().clone();
        assert_eq!(
            answer["details"]["field"],
            format!("labels.{key}"),
            "{answer}"
        );
    }
    let many: serde_json::Map<String, Value> =
        (0..33).map(|i| (format!("k{i}"), json!("v"))).collect();
    let answer = refusal(
        t.call(
            ALICE,
            "sandboxes.list",
            json!({ "tenantId": "acme", "labels": many.clone() }),
        )
        .await,
    );
    assert_eq!(answer["code"], "INVALID_INPUT");
    let body = json!({ "tenantId": "acme", "templateId": tpl, "idempotencyKey": "many",
                       "labels": many });
    assert_eq!(
        refusal(t.call(ALICE, "sandboxes.create", body).await)["code"],
        "INVALID_INPUT"
    );
    // Another tenant's sandbox does not exist for it.
    let body = json!({ "tenantId": "globex", "sandboxId": b_id, "labels": {} });
    assert_eq!(
        refusal(t.call(EVE, "sandboxes.setLabels", body).await)["code"],
        "NOT_FOUND"
    );
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_sandbox_stuck_starting_fails_at_its_deadline_and_releases_its_instance() {
    let t = TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.deadline_sandbox_starting = 60.0;
    })
    .await;
    let pool = t.hosted_pool("10.0.0.0/22", 0, quota(1000)).await;
    // A host whose guests never finish booting.
    let (node, token) = t.register_node(&pool, "slow").await;
    let _host = t.host(&node, &token, Duration::from_secs(3600));
    let tpl = template(&t, &pool, "stuck", json!({})).await;
    let s = t
        .ok(
            ALICE,
            "sandboxes.create",
            json!({ "tenantId": "acme", "templateId": tpl, "idempotencyKey": "stuck" }),
        )
        .await;
    assert_eq!(s["state"], "starting");
    let id = s["id"].as_str().unwrap();
    t.advance(Duration::from_secs(61));
    let failed = reaches(&t, id, "failed").await;
    assert_eq!(failed["reason"], "deadline:starting", "{failed}");
    // What it held is released: its instance is deleted, its address free.
    let inst_id = s["instanceId"].as_str().unwrap();
    eventually("the stuck sandbox's instance deleted", PATIENCE, || async {
        let inst = instance(&t, inst_id).await;
        if inst["state"] == "deleted" {
            Ok(())
        } else {
            Err(inst["state"].clone())
        }
    })
    .await;
    let leases = t
        .ok(OPERATOR, "pools.leases", json!({ "poolId": pool }))
        .await;
    assert!(leases["items"].as_array().unwrap().is_empty(), "{leases}");
    // It stays failed (not deleted behind the tenant's back) until deleted.
    t.quiet().await;
    assert_eq!(sandbox(&t, id).await["state"], "failed");
    let events = sandbox_events(&t, id).await;
    let fail = events
        .iter()
        .find(|e| e["type"] == "sandbox.failed")
        .expect("sandbox.failed");
    assert_eq!(fail["data"]["reason"], "deadline:starting");
    t.ok(ALICE, "sandboxes.delete", call(id)).await;
    reaches(&t, id, "deleted").await;
    assert!(t.replay_equal().await);
}
