//! `sandboxes.fork` on emulated hosts: one memory snapshot of the source, restored into
//! `count` sandboxes of their own; the same key answers the same sandboxes.

use std::time::Duration;

use serde_json::{json, Value};
use vps_emulators::host::HostHandle;
use vps_tests::{acme_sandbox, quota, TestServer, ALICE, OPERATOR};

const BOOT: Duration = Duration::from_millis(50);

/// A pool of one 16-vCPU node whose emulated host takes snapshots, a template `py` in it and a
/// ready sandbox of it.
async fn setup(t: &TestServer) -> (Value, HostHandle) {
    let pool = t.hosted_pool("10.0.0.0/24", 0, quota(100)).await;
    let body = json!({ "poolId": pool, "name": "n", "cpuModel": "epyc",
                       "capacity": { "vcpu": 16, "memoryGiB": 64, "diskGiB": 500 } });
    let answer = t.ok(OPERATOR, "nodes.register", body).await;
    let id = answer["node"]["id"].as_str().unwrap().to_string();
    let token = answer["nodeToken"].as_str().unwrap();
    let mut config = vps_emulators::host::HostConfig::new(t.server.url(), id, token);
    config.boot_delay = BOOT;
    config.report_interval = Duration::from_millis(200);
    config.poll_wait = Duration::from_millis(1000);
    config.snapshot_bytes = 64 * 1024;
    config.cpu_model = Some("epyc".into());
    config.tunnel_listen = Some("127.0.0.1:0".into());
    let host = vps_emulators::host::EmulatedHost::start(config);
    let template = t.sandbox_template(&pool, "py", json!({})).await;
    let source = t
        .ready_sandbox(&template["id"], "src", json!({ "ttlSeconds": 600 }))
        .await;
    (source, host)
}

fn fork_body(source: &Value, count: u64, key: &str) -> Value {
    json!({ "tenantId": "acme", "sandboxId": source["id"], "count": count, "idempotencyKey": key })
}

#[tokio::test]
async fn a_fork_of_three_makes_three_sandboxes_of_their_own_and_a_replay_answers_them_again() {
    let t = TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.snapshot_timeout = 60.0;
    })
    .await;
    let (source, _host) = setup(&t).await;
    let source_id = source["id"].as_str().unwrap();
    let forked = t
        .ok(ALICE, "sandboxes.fork", fork_body(&source, 3, "f1"))
        .await;
    assert_eq!(forked["sourceSandboxId"], source_id);
    let snapshot = forked["snapshotId"].as_str().unwrap().to_string();
    let made: Vec<String> = forked["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(made.len(), 3, "{forked}");
    for s in forked["sandboxes"].as_array().unwrap() {
        assert_eq!(s["fromSnapshot"], snapshot.as_str(), "{s}");
        assert_ne!(s["id"], source_id);
    }

    // Each one runs: its own instance, its own address, its own lifetime.
    let mut addresses = Vec::new();
    let mut instances = Vec::new();
    for id in &made {
        let s = vps_tests::eventually("the fork is ready", vps_tests::PATIENCE, || async {
            let s = t.ok(ALICE, "sandboxes.get", acme_sandbox(id)).await;
            if s["state"] == "ready" {
                Ok(s)
            } else {
                Err(s)
            }
        })
        .await;
        assert!(s["expiresAt"].is_string(), "{s}");
        let instance = t.instance(ALICE, s["instanceId"].as_str().unwrap()).await;
        instances.push(instance["id"].as_str().unwrap().to_string());
        addresses.push(instance["addresses"][0].as_str().unwrap().to_string());
    }
    instances.push(source["instanceId"].as_str().unwrap().to_string());
    let source_instance = t
        .instance(ALICE, source["instanceId"].as_str().unwrap())
        .await;
    addresses.push(
        source_instance["addresses"][0]
            .as_str()
            .unwrap()
            .to_string(),
    );
    for list in [&addresses, &instances] {
        let mut unique = list.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 4, "{list:?}");
    }

    // The same key answers the same sandboxes; another count with it is a conflict.
    let again = t
        .ok(ALICE, "sandboxes.fork", fork_body(&source, 3, "f1"))
        .await;
    let again_ids: Vec<&str> = again["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(again_ids, made);
    assert_eq!(again["snapshotId"], snapshot.as_str());
    let e = t
        .err(ALICE, "sandboxes.fork", fork_body(&source, 2, "f1"))
        .await;
    assert_eq!(e.body["code"], "CONFLICT", "{}", e.body);

    // One `sandbox.forked` names the source, the snapshot and the new sandboxes.
    t.settle().await;
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.forked"], "subject": format!("sandbox/{source_id}") }),
        )
        .await;
    let items = events["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{events}");
    let data = &items[0]["data"];
    assert_eq!(data["sourceSandboxId"], source_id);
    assert_eq!(data["snapshotId"], snapshot.as_str());
    assert_eq!(data["sandboxIds"], json!(made));
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_fork_count_outside_1_to_10_is_invalid_input_naming_count() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (source, _host) = setup(&t).await;
    for count in [0, 11] {
        let e = t
            .err(ALICE, "sandboxes.fork", fork_body(&source, count, "bad"))
            .await;
        assert_eq!(e.body["code"], "INVALID_INPUT", "{}", e.body);
        assert_eq!(e.body["details"]["field"], "count", "{}", e.body);
    }
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&source["id"]))
        .await;
    let e = t
        .err(ALICE, "sandboxes.fork", fork_body(&source, 1, "gone"))
        .await;
    assert_eq!(e.body["code"], "INVALID_STATE", "{}", e.body);
}
