//! Idle pause (issue 40) over HTTP against a real server with emulated hosts and a manual
//! clock: a template's `idleTimeoutSeconds` pauses (or, with `onTimeout: delete`, expires) a
//! ready sandbox whose guest stayed under `idleCpuPercent` with no exec session for that long.
//! The emulated host reports each guest's CPU seconds at a rate the test sets.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use vps_emulators::host::HostHandle;
use vps_tests::{acme_sandbox, eventually, quota, TestServer, ALICE, PATIENCE};

const BOOT: Duration = Duration::from_millis(50);

async fn setup(template: Value) -> (TestServer, HostHandle, String) {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (pool, mut hosts) = t.pool_with_hosts("10.0.0.0/24", quota(100), 1, BOOT).await;
    let tpl = t.sandbox_template(&pool, "idle", template).await;
    let tpl = tpl["id"].as_str().unwrap().to_string();
    (t, hosts.remove(0), tpl)
}

/// A ready sandbox whose guest's first CPU sample was taken: its idle clock runs from now.
async fn sampled_sandbox(t: &TestServer, template: &str, key: &str) -> (String, String) {
    let s = t
        .ready_sandbox(template, key, json!({ "ttlSeconds": 3600 }))
        .await;
    let (id, instance) = (
        s["id"].as_str().unwrap().to_string(),
        s["instanceId"].as_str().unwrap().to_string(),
    );
    next_sample(t, &instance, None).await;
    (id, instance)
}

/// When the guest's CPU seconds were last sampled, if ever.
async fn sampled_at(t: &TestServer, instance: &str) -> Option<DateTime<Utc>> {
    sqlx::query_scalar("SELECT sampled_at FROM sandbox_activity WHERE instance_id = $1")
        .bind(instance)
        .fetch_optional(&t.server.state.pool)
        .await
        .unwrap()
        .flatten()
}

/// Waits for a sample of the guest taken after `after`.
async fn next_sample(t: &TestServer, instance: &str, after: Option<DateTime<Utc>>) {
    eventually("a CPU sample of the guest", PATIENCE, || async {
        match sampled_at(t, instance).await {
            Some(at) if Some(at) > after => Ok(at),
            other => Err(other),
        }
    })
    .await;
}

/// Moves the clock by `seconds` and waits for the guest's next sample.
async fn advance_and_sample(t: &TestServer, instance: &str, seconds: u64) {
    let before = sampled_at(t, instance).await;
    t.advance(Duration::from_secs(seconds));
    next_sample(t, instance, before).await;
}

async fn state(t: &TestServer, id: &str) -> Value {
    t.ok(ALICE, "sandboxes.get", acme_sandbox(id)).await["state"].clone()
}

async fn reaches(t: &TestServer, id: &str, wanted: &str) {
    eventually(&format!("sandbox {id} {wanted}"), PATIENCE, || async {
        match state(t, id).await {
            s if s == wanted => Ok(()),
            s => Err(s),
        }
    })
    .await;
}

/// Some reconciler passes go by, then the sandbox is still ready.
async fn stays_ready(t: &TestServer, id: &str, why: &str) {
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(state(t, id).await, "ready", "{why}");
}

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

fn find<'a>(events: &'a [Value], event_type: &str) -> &'a Value {
    events
        .iter()
        .rev()
        .find(|e| e["type"] == event_type)
        .unwrap_or_else(|| panic!("no {event_type} in {events:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_sandbox_is_kept_and_pauses_once_idle_for_its_timeout() {
    let (t, host, tpl) = setup(json!({ "idleTimeoutSeconds": 60, "onTimeout": "pause" })).await;
    // Half a vCPU: far above the default 2 %.
    host.set_cpu_rate(None, 0.5);
    let (id, instance) = sampled_sandbox(&t, &tpl, "busy").await;
    // Busy past the timeout in steps just over a sample's spacing: a host report built before
    // an advance and applied after it is sampled at the new time with the CPU seconds of the
    // old, which reads as one quiet step; a single 61 s step would then read as idle.
    for _ in 0..6 {
        advance_and_sample(&t, &instance, 11).await;
    }
    stays_ready(&t, &id, "a busy guest is not idle").await;

    // Quiet from here: paused once the timeout has passed, not before.
    host.set_cpu_rate(None, 0.0);
    advance_and_sample(&t, &instance, 40).await;
    stays_ready(&t, &id, "quiet for 40 s of 60").await;
    advance_and_sample(&t, &instance, 21).await;
    reaches(&t, &id, "paused").await;
    let events = sandbox_events(&t, &id).await;
    assert_eq!(find(&events, "sandbox.pausing")["data"]["reason"], "idle");
    assert_eq!(find(&events, "sandbox.paused")["data"]["reason"], "idle");
    assert!(
        events.iter().all(|e| e["type"] != "sandbox.expired"),
        "an idle pause is no expiry"
    );
    // Resumed, it is ready again and its idle clock starts over.
    t.ok(ALICE, "sandboxes.resume", acme_sandbox(&id)).await;
    reaches(&t, &id, "ready").await;
    assert!(t.replay_equal().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_session_starts_the_idle_clock_again() {
    let (t, _host, tpl) = setup(json!({ "idleTimeoutSeconds": 60, "onTimeout": "pause" })).await;
    let (id, instance) = sampled_sandbox(&t, &tpl, "exec").await;
    advance_and_sample(&t, &instance, 40).await;
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("key");
    let made = tokio::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()
        .await
        .unwrap();
    assert!(made.success());
    let public_key = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    let body = json!({ "tenantId": "acme", "sandboxId": id, "publicKey": public_key.trim() });
    t.ok(ALICE, "sandboxes.exec", body).await;
    // 80 s in, 40 since the session: not idle yet.
    advance_and_sample(&t, &instance, 40).await;
    stays_ready(&t, &id, "the exec session 40 s ago keeps it").await;
    advance_and_sample(&t, &instance, 21).await;
    reaches(&t, &id, "paused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preview_request_starts_the_idle_clock_again() {
    let (t, _host, tpl) = setup(json!({ "idleTimeoutSeconds": 60, "onTimeout": "pause" })).await;
    let (id, instance) = sampled_sandbox(&t, &tpl, "preview").await;
    let body = json!({ "tenantId": "acme", "sandboxId": id, "port": 8080, "ttlSeconds": 600 });
    let exposed = t.ok(ALICE, "sandboxes.expose", body).await;
    advance_and_sample(&t, &instance, 40).await;
    let url = exposed["url"].as_str().unwrap();
    let answer = t.http.get(url).send().await.unwrap();
    assert_eq!(answer.status().as_u16(), 200);
    advance_and_sample(&t, &instance, 40).await;
    stays_ready(&t, &id, "the preview request 40 s ago keeps it").await;
    advance_and_sample(&t, &instance, 21).await;
    reaches(&t, &id, "paused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_timeout_delete_an_idle_sandbox_expires_naming_idle() {
    let (t, _host, tpl) = setup(json!({ "idleTimeoutSeconds": 60 })).await;
    let (id, _instance) = sampled_sandbox(&t, &tpl, "delete").await;
    // Not waiting for the next sample: the expiry it decides may delete the sandbox, and its
    // activity row with it, between two looks (failed so once under load).
    t.advance(Duration::from_secs(61));
    reaches(&t, &id, "deleted").await;
    let events = sandbox_events(&t, &id).await;
    let expired = find(&events, "sandbox.expired");
    assert_eq!(
        (&expired["data"]["reason"], &expired["data"]["action"]),
        (&json!("idle"), &json!("deleted"))
    );
    assert_eq!(find(&events, "sandbox.deleted")["data"]["reason"], "idle");
    assert!(t.replay_equal().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_update_that_sets_an_idle_timeout_reaches_its_ready_sandboxes() {
    let (t, _host, tpl) = setup(json!({})).await;
    let s = t
        .ready_sandbox(&tpl, "later", json!({ "ttlSeconds": 3600 }))
        .await;
    let (id, instance) = (s["id"].as_str().unwrap(), s["instanceId"].as_str().unwrap());
    t.advance(Duration::from_secs(61));
    stays_ready(&t, id, "no idle timeout yet").await;
    let update = json!({ "tenantId": "acme", "templateId": tpl, "idleTimeoutSeconds": 60 });
    t.ok(ALICE, "sandboxTemplates.update", update).await;
    next_sample(&t, instance, None).await;
    advance_and_sample(&t, instance, 61).await;
    reaches(&t, id, "deleted").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_reports_no_cpu_seconds_never_idles_a_sandbox_out() {
    let (t, host, tpl) = setup(json!({ "idleTimeoutSeconds": 60 })).await;
    host.report_cpu(false);
    let s = t
        .ready_sandbox(&tpl, "old-host", json!({ "ttlSeconds": 3600 }))
        .await;
    let id = s["id"].as_str().unwrap();
    for _ in 0..3 {
        t.advance(Duration::from_secs(61));
        stays_ready(&t, id, "no CPU seconds, no idleness").await;
    }
    let instance = s["instanceId"].as_str().unwrap();
    assert_eq!(sampled_at(&t, instance).await, None);
}

#[tokio::test]
async fn idle_settings_out_of_bounds_are_invalid_input_naming_the_field() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let pool = t.hosted_pool("10.0.0.0/24", 1, quota(100)).await;
    let create = |extra: Value| {
        let mut body = json!({ "tenantId": "acme", "name": "bounds", "poolId": pool,
                               "flavor": "small", "imageId": "img_ubuntu" });
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        body
    };
    for (extra, field) in [
        (json!({ "idleTimeoutSeconds": 59 }), "idleTimeoutSeconds"),
        (
            json!({ "idleTimeoutSeconds": 604_801 }),
            "idleTimeoutSeconds",
        ),
        (json!({ "idleCpuPercent": 0.01 }), "idleCpuPercent"),
        (json!({ "idleCpuPercent": 101 }), "idleCpuPercent"),
    ] {
        let refused = t
            .err(ALICE, "sandboxTemplates.create", create(extra.clone()))
            .await;
        assert_eq!(refused.body["code"], "INVALID_INPUT", "{extra}");
        assert_eq!(refused.body["details"]["field"], field, "{extra}");
    }
    let made = t
        .ok(
            ALICE,
            "sandboxTemplates.create",
            create(json!({ "idleTimeoutSeconds": 600, "idleCpuPercent": 5 })),
        )
        .await;
    assert_eq!(
        (&made["idleTimeoutSeconds"], &made["idleCpuPercent"]),
        (&json!(600), &json!(5.0))
    );
    let update = json!({ "tenantId": "acme", "templateId": made["id"], "idleTimeoutSeconds": 0 });
    let refused = t.err(ALICE, "sandboxTemplates.update", update).await;
    assert_eq!(
        (&refused.body["code"], &refused.body["details"]["field"]),
        (&json!("INVALID_INPUT"), &json!("idleTimeoutSeconds"))
    );
}
