//! Tenant teardown over HTTP (SPEC §3.10): new work refused at once, webhooks removed, every
//! live instance deleted with `reason: tenant deleted`, `tenant.deleted` once nothing is left,
//! and the other tenants untouched.

use std::time::Duration;

use serde_json::{json, Value};
use vps_tests::{acme_instance, TestServer, ALICE, EVE, OPERATOR, PATIENCE, SSH_KEY};

fn create(pool: &str, tenant: &str, key: &str) -> Value {
    json!({ "tenantId": tenant, "poolId": pool, "flavor": "small", "imageId": "img_ubuntu",
            "sshKeys": [SSH_KEY], "idempotencyKey": key })
}

#[tokio::test]
async fn deleting_a_tenant_refuses_new_work_and_deletes_everything_it_has() {
    let t = TestServer::start_with(|c| c.timings.transitional_look = 0.2).await;
    let quota = json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": 2000 });
    let pool = t.hosted_pool("10.0.0.0/24", 0, quota.clone()).await;
    t.ok(
        OPERATOR,
        "pools.offer",
        json!({ "poolId": pool, "tenantId": "globex", "quota": quota }),
    )
    .await;
    let (node, token) = t.register_node(&pool, "host").await;
    let _host = t.host(&node, &token, Duration::from_millis(50));
    let mut ids = Vec::new();
    for n in 0..3 {
        let inst = t
            .ok(
                ALICE,
                "instances.create",
                create(&pool, "acme", &format!("k{n}")),
            )
            .await;
        ids.push(inst["id"].as_str().unwrap().to_string());
    }
    let kept = t
        .ok(EVE, "instances.create", create(&pool, "globex", "eve"))
        .await;
    let hook = json!({ "url": "http://127.0.0.1:9/hook", "types": ["instance.*"] });
    t.ok(ALICE, "webhooks.create", hook.clone()).await;
    for id in &ids {
        t.until(ALICE, "acme", id, PATIENCE, |i| i["state"] == "running")
            .await;
    }

    let answer = t
        .ok(OPERATOR, "tenants.delete", json!({ "tenantId": "acme" }))
        .await;
    assert_eq!(answer["tenantId"], "acme");
    assert!(answer["remaining"].as_u64().unwrap() > 0, "{answer}");

    let refused = t
        .err(ALICE, "instances.create", create(&pool, "acme", "late"))
        .await;
    assert_eq!(refused.body["code"], "INVALID_STATE", "{}", refused.body);
    let refused = t.err(ALICE, "webhooks.create", hook).await;
    assert_eq!(refused.body["code"], "INVALID_STATE");
    assert_eq!(
        t.ok(ALICE, "webhooks.list", json!({})).await["items"],
        json!([])
    );

    t.teardown_done("acme").await;
    for id in &ids {
        let inst = t.ok(ALICE, "instances.get", acme_instance(id)).await;
        assert_eq!(inst["state"], "deleted");
        let history = t.ok(ALICE, "instances.history", acme_instance(id)).await;
        let deleting = history["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["type"] == "instance.deleting")
            .unwrap();
        assert_eq!(deleting["data"]["reason"], "tenant deleted");
    }
    let eve = t
        .ok(
            EVE,
            "instances.get",
            json!({ "tenantId": "globex", "instanceId": kept["id"] }),
        )
        .await;
    assert_ne!(
        eve["desiredState"], "deleted",
        "another tenant is untouched"
    );
    t.settle().await;
    let done = t
        .ok(OPERATOR, "events.list", json!({ "types": ["tenant.*"] }))
        .await;
    let types: Vec<&str> = done["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["tenant.deleting", "tenant.deleted"]);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn only_operators_delete_tenants() {
    let t = TestServer::start().await;
    let refused = t
        .err(ALICE, "tenants.delete", json!({ "tenantId": "acme" }))
        .await;
    assert_eq!(refused.body["code"], "ACCESS_DENIED");
    let empty = t
        .ok(OPERATOR, "tenants.delete", json!({ "tenantId": "initech" }))
        .await;
    assert_eq!(empty["remaining"], 0);
}
