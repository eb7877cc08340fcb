//! Cedar policies over HTTP: `policies.put/list/delete`, refusals with `details.policyIds`,
//! validation against the schema, the log's record of each change, and a second replica
//! seeing a change.

use serde_json::{json, Value};
use vps_tests::{eventually, TestServer, ALICE, EVE, OPERATOR, PATIENCE, SSH_KEY};

/// The reference's example: only small VMs (≤ 8 vCPU, no GPU) from verified images.
const SMALL_VERIFIED_VMS: &str = r#"forbid (principal, action == Action::"compute:instances:create", resource)
  unless { resource.vcpu <= 8 && resource.gpus == 0 && resource.imageVerified };"#;

fn create(pool: &str, key: &str, flavor: &str, image: &str) -> Value {
    json!({ "tenantId": "acme", "poolId": pool, "flavor": flavor, "imageId": image,
            "sshKeys": [SSH_KEY], "idempotencyKey": key })
}

async fn pool_with_images(t: &TestServer) -> String {
    let pool = t
        .hosted_pool(
            "10.0.0.0/24",
            2,
            json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": 2000 }),
        )
        .await;
    t.ok(
        OPERATOR,
        "flavors.create",
        json!({ "poolId": pool, "name": "huge", "vcpu": 12, "memoryGiB": 24, "diskGiB": 20 }),
    )
    .await;
    t.ok(OPERATOR, "images.register", json!({ "imageId": "img_signed", "url": "https://images.example/signed.qcow2", "sha256": "b".repeat(64), "format": "qcow2", "verified": true })).await;
    pool
}

async fn log_length(t: &TestServer) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn only_small_vms_from_verified_images_once_the_operator_says_so() {
    let t = TestServer::start().await;
    let pool = pool_with_images(&t).await;
    t.ok(
        ALICE,
        "instances.create",
        create(&pool, "before", "large", "img_ubuntu"),
    )
    .await;

    let put = t
        .ok(
            OPERATOR,
            "policies.put",
            json!({ "id": "small-verified-vms", "text": SMALL_VERIFIED_VMS }),
        )
        .await;
    assert_eq!(put["version"], 1);

    let before = log_length(&t).await;
    for (key, flavor, image) in [
        ("unverified", "small", "img_ubuntu"),
        ("too-big", "huge", "img_signed"),
    ] {
        let refused = t
            .err(ALICE, "instances.create", create(&pool, key, flavor, image))
            .await;
        assert_eq!(refused.status, 403, "{key}: {}", refused.body);
        assert_eq!(refused.body["code"], "ACCESS_DENIED");
        assert_eq!(
            refused.body["details"]["policyIds"],
            json!(["small-verified-vms"])
        );
    }
    assert_eq!(
        log_length(&t).await,
        before,
        "a refusal leaves nothing behind"
    );
    let allowed = t
        .ok(
            ALICE,
            "instances.create",
            create(&pool, "fine", "large", "img_signed"),
        )
        .await;
    assert_eq!(allowed["state"], "provisioning");
    // A replay of a create admitted before the policy is still answered (idempotency first).
    t.ok(
        ALICE,
        "instances.create",
        create(&pool, "before", "large", "img_ubuntu"),
    )
    .await;

    let deleted = t
        .ok(
            OPERATOR,
            "policies.delete",
            json!({ "id": "small-verified-vms" }),
        )
        .await;
    assert_eq!(deleted["version"], 2);
    t.ok(
        ALICE,
        "instances.create",
        create(&pool, "unverified", "small", "img_ubuntu"),
    )
    .await;
    assert!(t.replay_equal().await);
}

/// The reference's example: volumes of at most 100 GiB.
const VOLUME_CAP: &str = r#"forbid (principal, action == Action::"compute:sandboxes:manage", resource is Volume)
  when { resource.sizeGiB > 100 };"#;

#[tokio::test]
async fn a_volume_size_cap_holds_on_create_and_on_every_resize() {
    let t = TestServer::start().await;
    let pool = pool_with_images(&t).await;
    t.ok(
        OPERATOR,
        "policies.put",
        json!({ "id": "volume-cap", "text": VOLUME_CAP }),
    )
    .await;
    let volume = |key: &str, size: u64| {
        json!({ "tenantId": "acme", "poolId": pool, "name": key, "sizeGiB": size,
                "idempotencyKey": key })
    };
    let before = log_length(&t).await;
    let refused = t
        .err(ALICE, "sandboxVolumes.create", volume("big", 101))
        .await;
    assert_eq!(refused.body["code"], "ACCESS_DENIED", "{}", refused.body);
    assert_eq!(refused.body["details"]["policyIds"], json!(["volume-cap"]));
    assert_eq!(
        log_length(&t).await,
        before,
        "a refusal leaves nothing behind"
    );
    let v = t
        .ok(ALICE, "sandboxVolumes.create", volume("fits", 100))
        .await;
    let resize = |size: u64| json!({ "tenantId": "acme", "volumeId": v["id"], "sizeGiB": size });
    // A resize is decided on the size it would leave, so the cap cannot be passed by growing.
    let refused = t.err(ALICE, "sandboxVolumes.resize", resize(101)).await;
    assert_eq!(refused.body["details"]["policyIds"], json!(["volume-cap"]));
    let same = t.ok(ALICE, "sandboxVolumes.resize", resize(100)).await;
    assert_eq!(same["sizeGiB"], 100);
    let small = t
        .ok(ALICE, "sandboxVolumes.create", volume("small", 10))
        .await;
    let grown = t
        .ok(
            ALICE,
            "sandboxVolumes.resize",
            json!({ "tenantId": "acme", "volumeId": small["id"], "sizeGiB": 50 }),
        )
        .await;
    assert_eq!(grown["sizeGiB"], 50);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_policy_change_is_in_the_log_and_listed() {
    let t = TestServer::start().await;
    let text = r#"forbid (principal, action == Action::"compute:webhooks:create", resource);"#;
    t.ok(
        OPERATOR,
        "policies.put",
        json!({ "id": "no-webhooks", "tenantId": "acme", "text": text }),
    )
    .await;
    let again = t
        .ok(
            OPERATOR,
            "policies.put",
            json!({ "id": "no-webhooks", "tenantId": "acme", "text": text }),
        )
        .await;
    assert_eq!(
        again["version"], 1,
        "putting the same text again records nothing"
    );
    let listed = t.ok(OPERATOR, "policies.list", json!({})).await;
    assert_eq!(listed["items"][0]["id"], "no-webhooks");
    assert_eq!(listed["items"][0]["tenantId"], "acme");

    let hook = json!({ "url": "http://127.0.0.1:9/hook", "types": ["instance.*"] });
    let refused = t.err(ALICE, "webhooks.create", hook.clone()).await;
    assert_eq!(refused.body["details"]["policyIds"], json!(["no-webhooks"]));
    t.ok(EVE, "webhooks.create", hook).await;

    t.settle().await;
    let log = t
        .ok(OPERATOR, "events.list", json!({ "types": ["policy.*"] }))
        .await;
    let types: Vec<&str> = log["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["policy.put"]);
    assert_eq!(log["items"][0]["data"]["text"], text);
}

#[tokio::test]
async fn an_invalid_policy_is_invalid_input_with_cedars_message() {
    let t = TestServer::start().await;
    for (id, text) in [
        (
            "bad-attr",
            r#"forbid (principal, action == Action::"compute:instances:create", resource) when { resource.colour == "red" };"#,
        ),
        (
            "bad-action",
            r#"forbid (principal, action == Action::"compute:teleport:create", resource);"#,
        ),
        ("bad-syntax", "forbid (principal, action"),
    ] {
        let refused = t
            .err(OPERATOR, "policies.put", json!({ "id": id, "text": text }))
            .await;
        assert_eq!(refused.status, 400, "{id}: {}", refused.body);
        assert_eq!(refused.body["code"], "INVALID_INPUT");
        assert_eq!(refused.body["details"]["field"], "text");
    }
    let reserved = t
        .err(
            OPERATOR,
            "policies.put",
            json!({ "id": "baseline.x", "text": SMALL_VERIFIED_VMS }),
        )
        .await;
    assert_eq!(reserved.body["code"], "INVALID_INPUT");
    let tenant = t
        .err(
            ALICE,
            "policies.put",
            json!({ "id": "mine", "text": SMALL_VERIFIED_VMS }),
        )
        .await;
    assert_eq!(tenant.body["code"], "ACCESS_DENIED");
    let missing = t
        .err(OPERATOR, "policies.delete", json!({ "id": "nothing" }))
        .await;
    assert_eq!(missing.body["code"], "NOT_FOUND");
}

#[tokio::test]
async fn another_replica_applies_a_policy_change_quickly() {
    let t = TestServer::start().await;
    let replica = t.replica().await;
    let hook = json!({ "url": "http://127.0.0.1:9/hook", "types": ["instance.*"] });
    let http = reqwest::Client::new();
    let call_replica = || {
        let http = http.clone();
        let url = format!("{}/api/compute/webhooks/create", replica.url());
        let hook = hook.clone();
        async move {
            let r = http
                .post(url)
                .bearer_auth(ALICE)
                .json(&hook)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }
    };
    assert_eq!(call_replica().await, 200);
    let text = r#"forbid (principal, action == Action::"compute:webhooks:create", resource);"#;
    t.ok(
        OPERATOR,
        "policies.put",
        json!({ "id": "no-webhooks", "text": text }),
    )
    .await;
    let started = std::time::Instant::now();
    eventually("the replica refuses", PATIENCE, || async {
        match call_replica().await {
            403 => Ok(()),
            other => Err(other),
        }
    })
    .await;
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    replica.shutdown().await;
}

#[tokio::test]
async fn policies_from_the_configured_directory_apply_from_the_start() {
    let dir = std::env::temp_dir().join(format!("vps-policies-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("small.cedar"), SMALL_VERIFIED_VMS).unwrap();
    let t = TestServer::start_with(|c| c.policies.dir = Some(dir.clone())).await;
    let pool = pool_with_images(&t).await;
    let refused = t
        .err(
            ALICE,
            "instances.create",
            create(&pool, "k", "huge", "img_signed"),
        )
        .await;
    assert_eq!(
        refused.body["details"]["policyIds"],
        json!(["file:small.cedar"])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn the_event_stream_is_decided_like_events_list() {
    let t = TestServer::start().await;
    let text = r#"forbid (principal, action == Action::"compute:events:read", resource)
  when { resource has tenant && resource.tenant == "acme" };"#;
    t.ok(
        OPERATOR,
        "policies.put",
        json!({ "id": "no-event-reads", "text": text }),
    )
    .await;
    let stream = |token: &'static str| {
        let url = format!("{}/api/compute/events/stream", t.server.url());
        let http = t.http.clone();
        async move {
            let r = http.get(url).bearer_auth(token).send().await.unwrap();
            let status = r.status().as_u16();
            // A refusal is JSON; an open stream is read no further.
            let body: Value = if status == 200 {
                Value::Null
            } else {
                r.json().await.unwrap()
            };
            (status, body)
        }
    };
    let listed = t.err(ALICE, "events.list", json!({})).await;
    let (status, body) = stream(ALICE).await;
    assert_eq!(status, 403);
    assert_eq!(body["code"], "ACCESS_DENIED");
    assert_eq!(body["details"]["policyIds"], json!(["no-event-reads"]));
    assert_eq!(body["details"], listed.body["details"]);
    // Another tenant's stream opens.
    assert_eq!(stream(EVE).await.0, 200);
}
