//! Labels on instances and volumes (issue 40) over HTTP against a real server with emulated
//! hosts: at create and `setLabels`, in views, events and list filters, as Cedar tags, in
//! usage records and usage grouped by a label key; bad labels name their key.

use std::str::FromStr;
use std::time::Duration;

use rust_decimal::Decimal;
use serde_json::{json, Map, Value};
use vps_tests::{
    acme_instance, eventually, quota, TestServer, ALICE, EVE, OPERATOR, PATIENCE, SSH_KEY,
};

const BOOT: Duration = Duration::from_millis(50);

async fn server() -> TestServer {
    TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.usage_window = 0.5;
    })
    .await
}

fn instance_body(pool: &str, key: &str, labels: Value) -> Value {
    json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu",
            "sshKeys": [SSH_KEY], "idempotencyKey": key, "labels": labels })
}

fn refusal(answer: Result<Value, vps_tests::Answer>) -> Value {
    match answer {
        Ok(v) => panic!("succeeded where a refusal was expected: {v}"),
        Err(a) => a.body,
    }
}

fn ids(page: &Value) -> Vec<String> {
    let mut ids: Vec<String> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

fn many_labels() -> Value {
    let many: Map<String, Value> = (0..33).map(|i| (format!("k{i}"), json!("v"))).collect();
    Value::Object(many)
}

/// Bad labels are `INVALID_INPUT` naming the key, more than 32 too.
async fn assert_bad_labels_refused(t: &TestServer, method: &str, body: Value) {
    for (labels, field) in [
        (json!({ "-bad": "x" }), Some("labels.-bad")),
        (json!({ "team": "has space" }), Some("labels.team")),
        (many_labels(), None),
    ] {
        let mut body = body.clone();
        body["labels"] = labels;
        let answer = refusal(t.call(ALICE, method, body).await);
        assert_eq!(answer["code"], "INVALID_INPUT", "{method}: {answer}");
        if let Some(field) = field {
            assert_eq!(answer["details"]["field"], field, "{method}: {answer}");
        }
    }
}

#[tokio::test]
async fn labels_on_instances_are_set_listed_filtered_announced_and_checked() {
    let t = server().await;
    let (pool, _hosts) = t.pool_with_hosts("10.0.0.0/22", quota(1000), 1, BOOT).await;
    let a = t
        .ok(
            ALICE,
            "instances.create",
            instance_body(&pool, "a", json!({ "team": "ml" })),
        )
        .await;
    let b = t
        .ok(
            ALICE,
            "instances.create",
            instance_body(&pool, "b", json!({ "team": "web" })),
        )
        .await;
    assert_eq!(a["labels"], json!({ "team": "ml" }));
    let (a_id, b_id) = (a["id"].as_str().unwrap(), b["id"].as_str().unwrap());
    let list = |labels: Value| {
        t.ok(
            ALICE,
            "instances.list",
            json!({ "tenantId": "acme", "labels": labels }),
        )
    };
    assert_eq!(ids(&list(json!({ "team": "ml" })).await), [a_id]);
    assert_eq!(ids(&list(json!({})).await).len(), 2);
    assert!(ids(&list(json!({ "team": "ml", "env": "prod" })).await).is_empty());

    // setLabels replaces them; the same labels change nothing; the change is an event.
    let body = json!({ "tenantId": "acme", "instanceId": b_id,
                       "labels": { "team": "ml", "env": "prod" } });
    let b2 = t.ok(ALICE, "instances.setLabels", body.clone()).await;
    assert_eq!(b2["labels"], json!({ "team": "ml", "env": "prod" }));
    let again = t.ok(ALICE, "instances.setLabels", body).await;
    assert_eq!(
        again["version"], b2["version"],
        "the same labels change nothing"
    );
    assert_eq!(
        ids(&list(json!({ "team": "ml" })).await),
        sorted(vec![a_id.to_string(), b_id.to_string()])
    );
    assert_eq!(
        ids(&list(json!({ "team": "ml", "env": "prod" })).await),
        [b_id]
    );
    let history = t.ok(ALICE, "instances.history", acme_instance(b_id)).await;
    let labeled = history["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "instance.labeled")
        .expect("an instance.labeled event");
    assert_eq!(labeled["data"]["labels"]["env"], "prod");
    t.settle().await;
    let delivered = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["instance.labeled"], "subject": format!("instance/{b_id}") }),
        )
        .await;
    assert_eq!(delivered["items"].as_array().unwrap().len(), 1);

    // Bad labels, at create, setLabels and in a filter.
    assert_bad_labels_refused(
        &t,
        "instances.create",
        instance_body(&pool, "bad", json!({})),
    )
    .await;
    assert_bad_labels_refused(
        &t,
        "instances.setLabels",
        json!({ "tenantId": "acme", "instanceId": a_id }),
    )
    .await;
    let answer = refusal(
        t.call(
            ALICE,
            "instances.list",
            json!({ "tenantId": "acme", "labels": many_labels() }),
        )
        .await,
    );
    assert_eq!(answer["code"], "INVALID_INPUT");
    // Another tenant's instance does not exist for it.
    let body = json!({ "tenantId": "globex", "instanceId": a_id, "labels": {} });
    assert_eq!(
        refusal(t.call(EVE, "instances.setLabels", body).await)["code"],
        "NOT_FOUND"
    );
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn labels_on_volumes_are_set_listed_filtered_announced_and_checked() {
    let t = server().await;
    let (pool, _hosts) = t.pool_with_hosts("10.0.0.0/22", quota(1000), 1, BOOT).await;
    let volume = |name: &str, labels: Value| {
        json!({ "tenantId": "acme", "poolId": pool, "name": name, "sizeGiB": 5,
                "idempotencyKey": name, "labels": labels })
    };
    let a = t
        .ok(
            ALICE,
            "sandboxVolumes.create",
            volume("a", json!({ "team": "ml" })),
        )
        .await;
    t.ok(ALICE, "sandboxVolumes.create", volume("b", json!({})))
        .await;
    assert_eq!(a["labels"], json!({ "team": "ml" }));
    let a_id = a["id"].as_str().unwrap();
    let list = |labels: Value| {
        t.ok(
            ALICE,
            "sandboxVolumes.list",
            json!({ "tenantId": "acme", "labels": labels }),
        )
    };
    assert_eq!(ids(&list(json!({ "team": "ml" })).await), [a_id]);
    assert_eq!(ids(&list(json!({})).await).len(), 2);

    let body = json!({ "tenantId": "acme", "volumeId": a_id, "labels": { "team": "infra" } });
    let relabeled = t.ok(ALICE, "sandboxVolumes.setLabels", body).await;
    assert_eq!(relabeled["labels"], json!({ "team": "infra" }));
    assert!(ids(&list(json!({ "team": "ml" })).await).is_empty());
    assert_eq!(ids(&list(json!({ "team": "infra" })).await), [a_id]);
    t.settle().await;
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.volume.labeled"], "subject": format!("volume/{a_id}") }),
        )
        .await;
    let items = events["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{events}");
    assert_eq!(items[0]["data"]["labels"], json!({ "team": "infra" }));

    assert_bad_labels_refused(&t, "sandboxVolumes.create", volume("bad", json!({}))).await;
    assert_bad_labels_refused(
        &t,
        "sandboxVolumes.setLabels",
        json!({ "tenantId": "acme", "volumeId": a_id }),
    )
    .await;
    let answer = refusal(
        t.call(
            ALICE,
            "sandboxVolumes.list",
            json!({ "tenantId": "acme", "labels": many_labels() }),
        )
        .await,
    );
    assert_eq!(answer["code"], "INVALID_INPUT");
    let body = json!({ "tenantId": "globex", "volumeId": a_id, "labels": {} });
    assert_eq!(
        refusal(t.call(EVE, "sandboxVolumes.setLabels", body).await)["code"],
        "NOT_FOUND"
    );
    assert!(t.replay_equal().await);
}

const NO_RESTRICTED: &str = r#"forbid (principal, action in [Action::"compute:instances:create", Action::"compute:instances:update"], resource is Instance)
  when { resource.hasTag("team") && resource.getTag("team") == "restricted" };"#;

#[tokio::test]
async fn a_cedar_policy_on_a_label_refuses_what_it_names_and_nothing_else() {
    let t = server().await;
    let (pool, _hosts) = t.pool_with_hosts("10.0.0.0/22", quota(1000), 1, BOOT).await;
    t.ok(
        OPERATOR,
        "policies.put",
        json!({ "id": "no-restricted", "text": NO_RESTRICTED }),
    )
    .await;
    let refused = t
        .err(
            ALICE,
            "instances.create",
            instance_body(&pool, "r", json!({ "team": "restricted" })),
        )
        .await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert_eq!(
        refused.body["details"]["policyIds"],
        json!(["no-restricted"])
    );
    let ok = t
        .ok(
            ALICE,
            "instances.create",
            instance_body(&pool, "ok", json!({ "team": "ml" })),
        )
        .await;
    // Relabeling into the forbidden label is refused too.
    let body = json!({ "tenantId": "acme", "instanceId": ok["id"],
                       "labels": { "team": "restricted" } });
    let refused = t.err(ALICE, "instances.setLabels", body).await;
    assert_eq!(refused.status, 403, "{}", refused.body);
}

#[tokio::test]
async fn usage_records_carry_labels_and_usage_groups_by_a_label_key() {
    let t = server().await;
    let (pool, _hosts) = t.pool_with_hosts("10.0.0.0/22", quota(1000), 1, BOOT).await;
    let mut made = Vec::new();
    for (key, labels) in [
        ("ml-1", json!({ "team": "ml" })),
        ("ml-2", json!({ "team": "ml" })),
        ("web", json!({ "team": "web" })),
        ("none", json!({})),
    ] {
        let i = t
            .ok(ALICE, "instances.create", instance_body(&pool, key, labels))
            .await;
        made.push(i["id"].as_str().unwrap().to_string());
    }
    for id in &made {
        t.until(ALICE, "acme", id, PATIENCE, |i| i["state"] == "running")
            .await;
    }
    // A sandbox's instance carries the sandbox's labels, and follows a setLabels.
    let tpl = t.sandbox_template(&pool, "t", json!({})).await;
    let s = t
        .ready_sandbox(
            &tpl["id"],
            "s",
            json!({ "labels": { "team": "sbx", "x": "1" } }),
        )
        .await;
    let body = json!({ "tenantId": "acme", "sandboxId": s["id"], "labels": { "team": "sbx" } });
    t.ok(ALICE, "sandboxes.setLabels", body).await;
    let inst = t
        .ok(OPERATOR, "instances.get", acme_instance(&s["instanceId"]))
        .await;
    assert_eq!(inst["labels"], json!({ "team": "sbx" }), "{inst}");
    let groups = || async {
        t.ok(
            ALICE,
            "usage.list",
            json!({ "tenantId": "acme", "from": "2000-01-01T00:00:00Z",
                    "to": "2100-01-01T00:00:00Z", "groupBy": "label:team",
                    "meter": "vps.vcpu.hours" }),
        )
        .await
    };
    let answer = eventually("usage of every label value", PATIENCE, || async {
        let answer = groups().await;
        let values: Vec<Value> = answer["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["value"].clone())
            .collect();
        if values == [json!("ml"), json!("sbx"), json!("web"), Value::Null] {
            Ok(answer)
        } else {
            Err(answer)
        }
    })
    .await;
    assert!(answer["items"].as_array().unwrap().is_empty());
    let group = &answer["groups"][0];
    assert_eq!(group["label"], "team");
    assert_eq!(group["meter"], "vps.vcpu.hours");
    assert!(Decimal::from_str(group["quantity"].as_str().unwrap()).unwrap() > Decimal::ZERO);

    // The sum of a label value is the sum of its records, each carrying the labels.
    let records = t
        .ok(
            ALICE,
            "usage.list",
            json!({ "tenantId": "acme", "from": "2000-01-01T00:00:00Z",
                    "to": "2100-01-01T00:00:00Z", "resourceId": made[0],
                    "meter": "vps.vcpu.hours", "limit": 1000 }),
        )
        .await;
    let items = records["items"].as_array().unwrap();
    assert!(!items.is_empty());
    assert!(items.iter().all(|r| r["labels"] == json!({ "team": "ml" })));

    let bad = refusal(
        t.call(
            ALICE,
            "usage.list",
            json!({ "tenantId": "acme", "from": "2000-01-01T00:00:00Z",
                    "to": "2100-01-01T00:00:00Z", "groupBy": "team" }),
        )
        .await,
    );
    assert_eq!(bad["code"], "INVALID_INPUT");
    assert_eq!(bad["details"]["field"], "groupBy");

    // `vps usage export --group-by` sums the same.
    let mut out = Vec::new();
    let range = (
        "2000-01-01T00:00:00Z".parse().unwrap(),
        "2100-01-01T00:00:00Z".parse().unwrap(),
    );
    vps_api::tools::usage::export_groups(
        &t.server.state.pool,
        range,
        Some("acme".into()),
        "team",
        vps_api::tools::usage::Format::Csv,
        &mut out,
    )
    .await
    .unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.starts_with("label,value,meter,unit,quantity,records\n"),
        "{text}"
    );
    assert!(text.contains("team,ml,vps.vcpu.hours,vcpu-hour,"), "{text}");
    assert!(t.replay_equal().await);
}
